"""Packed Gemma3 text model as an embedding model (EmbeddingGemma): pre- and post-norm layers with
QK-norm, RoPE, GeGLU, and global layers between sliding-window ones.

    x = embed(ids) * sqrt(hidden)                      the scale rounded to the weights' dtype
    each layer: x = x + N_post_attn(Wo(attention(RoPE(QKnorm(Wqkv(N_in(x)))))))
                x = x + N_post_ff(Wdown(gelu(gate) * up)), gate | up = Wgate_up(N_pre_ff(x))
    N_final(x)

Every RMSNorm scales by (1 + weight); after_load stores the 1 + weight (and folds the embedding
scale into the table, and the attention scale into q's norm), so the forward runs the same
fused kernels as the other decoders: the residual add goes into the pre-norm that follows it,
and the post-norms are plain RMSNorms. Each layer kind has its own RoPE base and the sliding
layers their window (common/gemma3_config.py reads both as transformers does). Checkpoint layout
follows HF Gemma3TextModel (under "model." in Gemma3ForCausalLM); loader.py fills our parameters
through hf_weight_map().
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pollen.common.engine_options import EngineOptions
from pollen.common.gemma3_config import read_layout
from pollen.common.model_spec import ModelSpec
from pollen.worker.models import ops as references
from pollen.worker.models.attention import VarlenAttention
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.heads import make_head
from pollen.worker.models.ops import Ops, rope_cache
from pollen.worker.models.qwen3 import RMSNormWeight

# Our norm name -> the checkpoint's, in each layer.
_LAYER_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
                "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


class Gemma3Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, bias: bool,
                 sliding: bool):
        super().__init__()
        self.heads, self.kv_heads, self.sliding = heads, kv_heads, sliding
        for name in _LAYER_NORMS:
            setattr(self, name, RMSNormWeight(head_dim if name in ("q_norm", "k_norm") else hidden))
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=bias)
        self.o = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)


class Gemma3Encoder(EmbeddingModel):
    hf_prefixes = ("", "model.")

    def __init__(self, spec: ModelSpec, config: dict, ops: Ops):
        super().__init__()
        self.spec, self.ops = spec, ops
        layout = self.layout = read_layout(config)  # checked by common/model_spec.py
        self.causal = spec.causal
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.head_dim, self.eps = layout.head_dim, layout.eps
        self.max_positions = int(config["max_position_embeddings"])
        self.embed = nn.Embedding(config["vocab_size"], hidden)
        self.layers = nn.ModuleList(
            Gemma3Layer(hidden, heads, layout.kv_heads, layout.head_dim, config["intermediate_size"],
                        layout.attention_bias, sliding)
            for sliding in layout.sliding_layers)
        self.norm = RMSNormWeight(hidden)
        self.output_head = make_head(spec, config)
        # One attention per layer kind: the window is the kernel's to apply, chosen here once.
        self.attention = {False: VarlenAttention.of(ops, self.head_dim),
                          True: VarlenAttention.of(ops, self.head_dim, window=layout.half_width(self.causal))}
        self._rope: dict[bool, torch.Tensor] = {}  # by layer kind, built on first use on the weights' device
        # The Triton RoPE kernel works on power-of-two halves of a head; other sizes take the reference.
        pow2 = self.head_dim >= 2 and self.head_dim & (self.head_dim - 1) == 0
        self.qk_norm_rope = ops.qk_norm_rope if pow2 else references.qk_norm_rope

    def rope(self, sliding: bool, device) -> torch.Tensor:
        cache = self._rope.get(sliding)
        if cache is None or cache.device != device:
            params = self.layout.rope["sliding_attention" if sliding else "full_attention"]
            cache = self._rope[sliding] = rope_cache(float(params["rope_theta"]), self.head_dim, self.max_positions,
                                                     device, scaling=params)
        return cache

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int) -> torch.Tensor:
        if max_seqlen > self.max_positions:
            # Checked on the host int: an out-of-range position is a device assert on CUDA.
            raise ValueError(f"sequence of {max_seqlen} tokens exceeds {self.max_positions} positions")
        ops, eps, tokens = self.ops, self.eps, input_ids.shape[0]
        caches = {kind: self.rope(kind, input_ids.device) for kind in (False, True)}
        norms = [layer.attn_norm.weight for layer in self.layers[1:]] + [self.norm.weight]
        x, residual = ops.embed_rms_norm(input_ids, self.embed.weight, self.layers[0].attn_norm.weight, eps)
        for layer, next_norm in zip(self.layers, norms):
            q, k, v = self.qk_norm_rope(layer.qkv(x), layer.q_norm.weight, layer.k_norm.weight,
                                        caches[layer.sliding], positions, layer.heads, layer.kv_heads, eps)
            attn = self.attention[layer.sliding](q, k, v, cu_seqlens, max_seqlen, causal=self.causal)
            attn, _ = ops.add_rms_norm(layer.o(attn.reshape(tokens, -1)), None, layer.post_attn_norm.weight, eps)
            x, residual = ops.add_rms_norm(attn, residual, layer.mlp_norm.weight, eps)
            mlp = layer.down(ops.gelu_mul(layer.gate_up(x), self.layout.gelu))
            mlp, _ = ops.add_rms_norm(mlp, None, layer.post_mlp_norm.weight, eps)
            # The next layer's input norm (or the final norm) takes this layer's residual add.
            x, residual = ops.add_rms_norm(mlp, residual, next_norm, eps)
        return x

    @torch.no_grad()
    def after_load(self, options: EngineOptions) -> None:
        """The checkpoint's weights in the form the forward's kernels take: every norm weight w as
        1 + w (Gemma's RMSNorm scales by it), computed in float32; q's norm times
        sqrt(head_dim / query_pre_attn_scalar), so that attention's default 1/sqrt(head_dim) scale
        is Gemma's 1/sqrt(query_pre_attn_scalar) (RoPE is linear, the factor passes through it);
        and the embedding table times sqrt(hidden_size) rounded to the table's dtype, as
        transformers multiplies the looked-up rows (the same product, element by element)."""
        self.head_after_load()
        q_factor = math.sqrt(self.head_dim / self.layout.query_pre_attn_scalar)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                factor = q_factor if name.endswith("q_norm.weight") else 1.0
                param.copy_(((param.float() + 1.0) * factor).to(param.dtype))
        weight = self.embed.weight
        weight.copy_(weight * torch.tensor(weight.shape[1] ** 0.5, dtype=weight.dtype))

    def hf_weight_map(self) -> dict[str, list[str]]:
        m = self.head_weight_map()
        m |= {"embed.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
        for i, layer in enumerate(self.layers):
            ours, hf = f"layers.{i}.", f"layers.{i}."
            m |= {f"{ours}{name}.weight": [f"{hf}{theirs}.weight"] for name, theirs in _LAYER_NORMS.items()}
            m[ours + "qkv.weight"] = [hf + f"self_attn.{n}_proj.weight" for n in "qkv"]
            m[ours + "o.weight"] = [hf + "self_attn.o_proj.weight"]
            if layer.qkv.bias is not None:
                m[ours + "qkv.bias"] = [hf + f"self_attn.{n}_proj.bias" for n in "qkv"]
                m[ours + "o.bias"] = [hf + "self_attn.o_proj.bias"]
            m[ours + "gate_up.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
            m[ours + "down.weight"] = [hf + "mlp.down_proj.weight"]
        return m
