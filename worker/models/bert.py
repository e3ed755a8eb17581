"""Packed BERT-style encoder (BERT, RoBERTa, XLM-R, DistilBERT): post-LayerNorm layers,
bidirectional attention; on a masked-LM checkpoint served as SPLADE, its MLM head after the layers.

Checkpoint layout follows HF BertModel, or DistilBertModel (the same layers under its own names,
and no token type embeddings); loader.py fills our parameters through hf_weight_map().

A cross-encoder's pair carries its token types in its ids (spec.type_offset, set to vocab_size
when the model has two token types): an id i >= vocab_size is word i - vocab_size of type 1.
after_load turns the word table into one of 2 x vocab_size rows, word + type[0] then word +
type[1], so the embedding stays one lookup plus the position row, summed in HF's order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pollen.common.engine_options import EngineOptions
from pollen.common.model_spec import ModelSpec, position_offset
from pollen.worker.models.attention import VarlenAttention
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.cpu_linear import pack
from pollen.worker.models.heads import make_head
from pollen.worker.models.ops import Ops
from pollen.worker.models.splade import SpladeWeights


class BertLayer(nn.Module):
    """One post-norm layer. `attention` is VarlenAttention, or anything called as it is (MPNet's
    RelativeAttention, which adds its position bias)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, act: str, attention: VarlenAttention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.qkv = nn.Linear(hidden, 3 * hidden)  # query, key, value fused: one matmul
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        # HF "gelu" is the exact erf form; "gelu_new"/"gelu_pytorch_tanh" the tanh approximation.
        self.gelu = "none" if act == "gelu" else "tanh"
        self.up_applies_gelu = False  # prepack fused the GELU into `up`

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.heads, -1).unbind(1)
        attn = self.attention(q, k, v, cu_seqlens, max_seqlen, causal=False).reshape(tokens, -1)
        return self.after_attention(x, attn)

    def after_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer past its attention (`attn`: the heads' outputs side by side, x's shape): the
        output product, the residual norm and the MLP. Any leading shape: the ONNX export runs it
        on padded [batch, length, hidden] (worker/export.py)."""
        x = self.attn_norm(x + self.attn_out(attn))
        up = self.up(x) if self.up_applies_gelu else F.gelu(self.up(x), approximate=self.gelu)
        return self.mlp_norm(x + self.down(up))

    def prepack(self) -> int:
        """On the CPU: `up` through oneDNN with its GELU in the same pass (worker/models/cpu_linear.py)."""
        packed = pack(self.up, "gelu" if self.gelu == "none" else "gelu_tanh")
        if packed is self.up:
            return 0
        self.up, self.up_applies_gelu = packed, True
        return 1


# Checkpoint names of one layer's tensors (our name -> theirs, each without .weight/.bias), by layout.
_LAYER_NAMES = {
    "bert": {"qkv": ["attention.self.query", "attention.self.key", "attention.self.value"],
             "attn_out": ["attention.output.dense"], "attn_norm": ["attention.output.LayerNorm"],
             "up": ["intermediate.dense"], "down": ["output.dense"], "mlp_norm": ["output.LayerNorm"]},
    "distilbert": {"qkv": ["attention.q_lin", "attention.k_lin", "attention.v_lin"],
                   "attn_out": ["attention.out_lin"], "attn_norm": ["sa_layer_norm"],
                   "up": ["ffn.lin1"], "down": ["ffn.lin2"], "mlp_norm": ["output_layer_norm"]},
}


class BertEncoder(EmbeddingModel):
    hf_prefixes = ("", "bert.", "roberta.", "distilbert.")

    def __init__(self, spec: ModelSpec, config: dict, ops: Ops):
        super().__init__()
        self.spec, self.ops = spec, ops
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        eps = config.get("layer_norm_eps", 1e-12)
        attention = VarlenAttention.of(ops, hidden // heads)  # the layers' norms and GELU are torch's own
        self.word = nn.Embedding(config["vocab_size"], hidden)
        self.position = nn.Embedding(config["max_position_embeddings"], hidden)
        types = config.get("type_vocab_size", 2)  # 0: none (DistilBERT; common/model_spec.read_config)
        self.token_type = nn.Embedding(types, hidden) if types else None
        self.layout = "distilbert" if config.get("model_type") == "distilbert" else "bert"
        self.emb_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            BertLayer(hidden, heads, config["intermediate_size"], eps, config.get("hidden_act", "gelu"), attention)
            for _ in range(config["num_hidden_layers"])
        )
        self.position_offset = position_offset(config)
        self.max_positions = config["max_position_embeddings"] - self.position_offset
        self.output_head = make_head(spec, config)
        # A SPLADE model's hidden states are each token's vocabulary weights (worker/models/splade.py).
        self.splade = SpladeWeights(config, self.layout) if spec.sparse_terms else None
        self.typed_words = False  # whether after_load summed the token types into the word table

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int) -> torch.Tensor:
        if max_seqlen > self.max_positions:
            # Checked on the host int: an out-of-range position is a device assert on CUDA.
            raise ValueError(f"sequence of {max_seqlen} tokens exceeds {self.max_positions} positions")
        x = self.embed(input_ids, positions)
        for layer in self.layers:
            x = layer(x, cu_seqlens, max_seqlen)
        return self.last(x)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input: word, token type and position rows, summed in HF's order, then
        the LayerNorm. Any shape of ids whose positions broadcast to it (the export's [batch, L]
        beside positions [L])."""
        pos = positions + self.position_offset
        if self.typed_words or self.token_type is None:  # the ids carry the token type, or there are none
            x = self.word(input_ids) + self.position(pos)
        else:  # every token has type 0 (single-text input); same summation order as HF
            x = self.word(input_ids) + self.token_type.weight[0] + self.position(pos)
        return self.emb_norm(x)

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """What the model answers of its last layer's states: those states, or a SPLADE model's
        vocabulary weights of each token."""
        return x if self.splade is None else self.splade(x, self.word.weight)

    @torch.no_grad()
    def after_load(self, options: EngineOptions) -> None:
        """A cross-encoder's word table with its token types summed in (the module docstring)."""
        self.head_after_load()
        if not self.spec.type_offset:
            return
        words, types = self.word.weight, self.token_type.weight
        if self.spec.type_offset != words.shape[0]:
            raise AssertionError(f"type_offset {self.spec.type_offset} is not the vocabulary's {words.shape[0]} "
                                 "rows. This is a bug.")
        table = torch.cat([words + types[0], words + types[1]])
        self.word.weight = nn.Parameter(table, requires_grad=False)
        self.typed_words = True

    def hf_weight_map(self) -> dict[str, list[str]]:
        m = self.head_weight_map()
        m |= {
            "word.weight": ["embeddings.word_embeddings.weight"],
            "position.weight": ["embeddings.position_embeddings.weight"],
        }
        if self.token_type is not None:
            m["token_type.weight"] = ["embeddings.token_type_embeddings.weight"]
        if self.splade is not None:
            m |= {f"splade.{ours}": names for ours, names in self.splade.hf_weight_map().items()}
        layers = "transformer.layer" if self.layout == "distilbert" else "encoder.layer"
        for p in ("weight", "bias"):
            m[f"emb_norm.{p}"] = [f"embeddings.LayerNorm.{p}"]
            for i in range(len(self.layers)):
                for ours, names in _LAYER_NAMES[self.layout].items():
                    m[f"layers.{i}.{ours}.{p}"] = [f"{layers}.{i}.{name}.{p}" for name in names]
        return m
