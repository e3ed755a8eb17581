"""Packed MPNet encoder (all-mpnet-base-v2, multi-qa-mpnet): BERT's post-LayerNorm layers with a
relative-position bias added to every layer's attention scores (worker/models/relative_position.py).

The embedding is word + absolute position, then LayerNorm: no token types. Positions are numbered
from 2, RoBERTa-style (HF fixes MPNet's padding index at 1; common/model_spec.position_offset).
The bias comes from one [buckets, heads] embedding shared by all layers; after_load turns it into
the [heads, 2 * MAX_DISTANCE + 1] table the attention reads. Checkpoint layout follows HF MPNetModel
("mpnet." in front for MPNetForMaskedLM, as all-mpnet-base-v2 is saved); loader.py fills our
parameters through hf_weight_map(). The pooler is never read: sentence-transformers pools itself.
"""

from __future__ import annotations

import torch
from torch import nn

from pollen.common.engine_options import EngineOptions
from pollen.common.model_spec import MPNET_BUCKETS, ModelSpec, position_offset
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.bert import BertLayer
from pollen.worker.models.ops import Ops
from pollen.worker.models.relative_position import RelativeAttention, bias_table


class MPNetEncoder(EmbeddingModel):
    hf_prefixes = ("", "mpnet.")

    def __init__(self, spec: ModelSpec, config: dict, ops: Ops):
        super().__init__()
        self.spec, self.ops = spec, ops
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        eps = config.get("layer_norm_eps", 1e-12)
        self.attention = RelativeAttention.of(ops)  # one for all layers: they share the bias table
        self.word = nn.Embedding(config["vocab_size"], hidden)
        self.position = nn.Embedding(config["max_position_embeddings"], hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=eps)
        self.relative_bias = nn.Embedding(config.get("relative_attention_num_buckets", MPNET_BUCKETS), heads)
        self.layers = nn.ModuleList(
            BertLayer(hidden, heads, config["intermediate_size"], eps, config.get("hidden_act", "gelu"),
                      self.attention)
            for _ in range(config["num_hidden_layers"])
        )
        self.position_offset = position_offset(config)
        self.max_positions = config["max_position_embeddings"] - self.position_offset
        self.output_head = None  # sentence-transformers embedders only

    @property
    def host_syncs(self) -> bool:
        return self.attention.host_syncs

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int) -> torch.Tensor:
        if max_seqlen > self.max_positions:
            # Checked on the host int: an out-of-range position is a device assert on CUDA.
            raise ValueError(f"sequence of {max_seqlen} tokens exceeds {self.max_positions} positions")
        x = self.embed(input_ids, positions)
        for layer in self.layers:
            x = layer(x, cu_seqlens, max_seqlen)
        return x

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Word and position rows, then the LayerNorm (any shapes that broadcast, as BertEncoder.embed)."""
        return self.emb_norm(self.word(input_ids) + self.position(positions + self.position_offset))

    @torch.no_grad()
    def after_load(self, options: EngineOptions) -> None:
        self.attention.table = bias_table(self.relative_bias.weight)

    def hf_weight_map(self) -> dict[str, list[str]]:
        m = {
            "word.weight": ["embeddings.word_embeddings.weight"],
            "position.weight": ["embeddings.position_embeddings.weight"],
            "relative_bias.weight": ["encoder.relative_attention_bias.weight"],
        }
        for p in ("weight", "bias"):
            m[f"emb_norm.{p}"] = [f"embeddings.LayerNorm.{p}"]
            for i in range(len(self.layers)):
                ours, hf = f"layers.{i}.", f"encoder.layer.{i}."
                m[ours + f"qkv.{p}"] = [hf + f"attention.attn.{n}.{p}" for n in ("q", "k", "v")]
                m[ours + f"attn_out.{p}"] = [hf + f"attention.attn.o.{p}"]
                m[ours + f"attn_norm.{p}"] = [hf + f"attention.LayerNorm.{p}"]
                m[ours + f"up.{p}"] = [hf + f"intermediate.dense.{p}"]
                m[ours + f"down.{p}"] = [hf + f"output.dense.{p}"]
                m[ours + f"mlp_norm.{p}"] = [hf + f"output.LayerNorm.{p}"]
        return m
