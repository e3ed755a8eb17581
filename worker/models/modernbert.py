"""Packed ModernBERT encoder (gte-modernbert, modernbert-embed): pre-norm layers with RoPE, GeGLU,
and global layers between sliding-window ones.

    x = LayerNorm(embed(ids))                        the embedding norm; no positions, no token types
    each layer: h = x (layer 0) or LayerNorm(x)
                x = x + Wo(attention(RoPE(Wqkv(h))))  global, or within +-window of each token
                x = x + Wo(gelu(first) * second), first | second = Wi(LayerNorm(x))
    LayerNorm(x)                                     the final norm

Every layer kind has its own RoPE base (common/modernbert_config.py reads which layer is which,
the window and the bases, as transformers does). The LayerNorms are biasless unless norm_bias.
Checkpoint layout follows HF ModernBertModel (under "model." in ModernBertForMaskedLM);
loader.py fills our parameters through hf_weight_map().
"""

from __future__ import annotations

import torch
from torch import nn

from pollen.common.model_spec import ModelSpec
from pollen.common.modernbert_config import ModernBertLayout, read_layout
from pollen.worker.models import ops as references
from pollen.worker.models.attention import VarlenAttention
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.heads import make_head
from pollen.worker.models.ops import Ops, rope_cache


class ModernBertLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, layout: ModernBertLayout, first: bool, is_global: bool):
        super().__init__()
        self.is_global = is_global
        norm = dict(eps=layout.eps, bias=layout.norm_bias)
        self.attn_norm = None if first else nn.LayerNorm(hidden, **norm)  # layer 0 reads the embedding norm
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=layout.attention_bias)
        self.attn_out = nn.Linear(hidden, hidden, bias=layout.attention_bias)
        self.mlp_norm = nn.LayerNorm(hidden, **norm)
        self.up = nn.Linear(hidden, 2 * intermediate, bias=layout.mlp_bias)  # gated half, then the other
        self.down = nn.Linear(intermediate, hidden, bias=layout.mlp_bias)


class ModernBertEncoder(EmbeddingModel):
    hf_prefixes = ("", "model.")

    def __init__(self, spec: ModelSpec, config: dict, ops: Ops):
        super().__init__()
        self.spec, self.ops = spec, ops
        layout = self.layout = read_layout(config)
        hidden = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.head_dim = hidden // self.heads
        self.max_positions = int(config["max_position_embeddings"])
        self.embed = nn.Embedding(config["vocab_size"], hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=layout.eps, bias=layout.norm_bias)
        self.layers = nn.ModuleList(
            ModernBertLayer(hidden, config["intermediate_size"], layout, i == 0, is_global)
            for i, is_global in enumerate(layout.global_layers))
        self.final_norm = nn.LayerNorm(hidden, eps=layout.eps, bias=layout.norm_bias)
        self.output_head = make_head(spec, config)
        # One attention per layer kind: the window is the kernel's to apply, chosen here once.
        self.attention = {True: VarlenAttention.of(ops, self.head_dim),
                          False: VarlenAttention.of(ops, self.head_dim, window=layout.window)}
        self._rope: dict[bool, torch.Tensor] = {}  # by layer kind, built on first use on the weights' device
        # The Triton RoPE kernel works on power-of-two halves of a head; other sizes take the reference.
        pow2 = self.head_dim >= 2 and self.head_dim & (self.head_dim - 1) == 0
        self.qk_rope = ops.qk_norm_rope if pow2 else references.qk_norm_rope

    def rope(self, is_global: bool, device) -> torch.Tensor:
        cache = self._rope.get(is_global)
        if cache is None or cache.device != device:
            theta = self.layout.global_theta if is_global else self.layout.local_theta
            cache = self._rope[is_global] = rope_cache(theta, self.head_dim, self.max_positions, device)
        return cache

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int) -> torch.Tensor:
        if max_seqlen > self.max_positions:
            # Checked on the host int: an out-of-range position is a device assert on CUDA.
            raise ValueError(f"sequence of {max_seqlen} tokens exceeds {self.max_positions} positions")
        ops, tokens = self.ops, input_ids.shape[0]
        caches = {kind: self.rope(kind, input_ids.device) for kind in (True, False)}
        x = self.emb_norm(self.embed(input_ids))
        for layer in self.layers:
            h = x if layer.attn_norm is None else layer.attn_norm(x)
            # No QK-norm: qk_norm_rope without weights only splits and rotates.
            q, k, v = self.qk_rope(layer.qkv(h), None, None, caches[layer.is_global], positions, self.heads,
                                   self.heads, 0.0)
            attn = self.attention[layer.is_global](q, k, v, cu_seqlens, max_seqlen, causal=False)
            x = x + layer.attn_out(attn.reshape(tokens, -1))
            x = x + layer.down(ops.gelu_mul(layer.up(layer.mlp_norm(x)), self.layout.gelu))
        return self.final_norm(x)

    def hf_weight_map(self) -> dict[str, list[str]]:
        modules = {"embed": "embeddings.tok_embeddings", "emb_norm": "embeddings.norm", "final_norm": "final_norm"}
        for i in range(len(self.layers)):
            ours, hf = f"layers.{i}.", f"layers.{i}."
            modules |= {ours + "attn_norm": hf + "attn_norm", ours + "mlp_norm": hf + "mlp_norm",
                        ours + "qkv": hf + "attn.Wqkv", ours + "attn_out": hf + "attn.Wo",
                        ours + "up": hf + "mlp.Wi", ours + "down": hf + "mlp.Wo"}
        m = self.head_weight_map()
        for name, _ in self.named_parameters():  # the biases the config gives, and no attn_norm in layer 0
            module, _, part = name.rpartition(".")
            if module in modules:
                m[name] = [f"{modules[module]}.{part}"]
        return m
