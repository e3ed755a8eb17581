"""Packed Qwen3-style decoder as an embedding model: Qwen3-Embedding (causal, last-token pooling),
pplx-embed-v1 (`bidirectional_pplx_qwen3`: the same layers with bidirectional attention, mean
pooling), and the decoders that differ from Qwen3 only in what their layers leave out or add:
Qwen2 (gte-Qwen2, stella: no QK-norm, biases on q, k and v), Mistral and Llama (e5-mistral,
SFR-Embedding-Mistral, Linq: no QK-norm; Llama's attention_bias puts biases on q, k, v and o).

Pre-norm layers: RMSNorm -> fused QKV projection -> per-head RMSNorm of q and k (QK-norm, Qwen3
only) -> RoPE -> grouped-query varlen attention -> output projection, then RMSNorm -> fused
gate/up projection -> SiLU(gate) * up -> down projection. The residual add is fused into the next
RMSNorm. Checkpoint layout follows HF Qwen3Model (which Qwen2Model, MistralModel and LlamaModel
share); loader.py fills our parameters through hf_weight_map().
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pollen.common.engine_options import EngineOptions
from pollen.common.model_spec import QWEN3_TYPES, ModelSpec, rope_parameters, sliding_window
from pollen.worker import kernels
from pollen.worker.models.attention import VarlenAttention
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.heads import make_head
from pollen.worker.models.ops import Ops, rope_cache


class RMSNormWeight(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))


def attention_biases(config: dict) -> tuple[bool, bool]:
    """(q/k/v biases, o bias) as transformers builds each decoder: Qwen2 always has the first and
    never the second, Mistral neither, Qwen3 and Llama both when attention_bias says so."""
    model_type = config.get("model_type")
    if model_type == "qwen2":
        return True, False
    if model_type == "mistral":
        return False, False
    bias = bool(config.get("attention_bias", False))
    return bias, bias


class Qwen3Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attn_norm = RMSNormWeight(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=qkv_bias)
        self.q_norm = RMSNormWeight(head_dim) if qk_norm else None
        self.k_norm = RMSNormWeight(head_dim) if qk_norm else None
        self.o = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self.mlp_norm = RMSNormWeight(hidden)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)


class Qwen3Encoder(EmbeddingModel):
    hf_prefixes = ("", "model.")
    fp8_fused = ("qkv", "gate_up", "down")  # fp8_hidden_states: the norms and the SiLU-gate quantize them

    def __init__(self, spec: ModelSpec, config: dict, ops: Ops):
        super().__init__()
        self.spec, self.ops = spec, ops
        self.causal = spec.causal
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.rope_parameters = rope_parameters(config)  # checked by common/model_spec.py
        self.max_positions = int(config["max_position_embeddings"])
        self.embed = nn.Embedding(config["vocab_size"], hidden)
        qk_norm = config.get("model_type") in QWEN3_TYPES
        self.layers = nn.ModuleList(
            Qwen3Layer(hidden, heads, config.get("num_key_value_heads") or heads, head_dim,
                       config["intermediate_size"], *attention_biases(config), qk_norm)
            for _ in range(config["num_hidden_layers"])
        )
        self.norm = RMSNormWeight(hidden)
        self.output_head = make_head(spec, config)  # reads the final norm's output, as HF's heads do
        self._rope: torch.Tensor | None = None  # built on first use, on the weights' device
        # Mistral's window: a token sees the window - 1 tokens before it (a half-width of window - 1;
        # symmetric under --attention bidirectional, as transformers' flash path applies it).
        window = sliding_window(spec.path, config)
        self.attention = VarlenAttention.of(ops, head_dim, window=None if window is None else window - 1)
        # Short sequences: QK-norm, RoPE and attention in one kernel per layer (launches are their cost).
        takes = kernels.short_attention_takes(head_dim, rope=True)
        self.short_qk_rope_attention = ops.short_qk_rope_attention if takes else None
        self.folded = False  # whether after_load folded the norms into the products (the query kernels need it)
        self.query_kernels = False  # whether queries may take the skinny products (after_load decides)
        self.fp8_min_tokens: int | None = None  # fp8 products from this many tokens a batch (after_quantize)

    def rope(self, device) -> torch.Tensor:
        if self._rope is None or self._rope.device != device:
            rope = self.rope_parameters
            self._rope = rope_cache(float(rope["rope_theta"]), self.layers[0].head_dim, self.max_positions, device,
                                    scaling=rope)
        return self._rope

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int) -> torch.Tensor:
        if max_seqlen > self.max_positions:
            # Checked on the host int: an out-of-range position is a device assert on CUDA.
            raise ValueError(f"sequence of {max_seqlen} tokens exceeds {self.max_positions} positions")
        ops = self.ops
        add_rms_norm, silu_mul = ops.add_rms_norm, ops.silu_mul
        # The fused short kernel has no window: it takes what the attention's short kernel would.
        short = self.short_qk_rope_attention is not None and max_seqlen <= self.attention.short_max
        attend = functools.partial(self.attend, short=short, cache=self.rope(input_ids.device),
                                   positions=positions, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if self.fits_query_kernels(input_ids.shape[0]):
            return self.query_hidden_states(input_ids, attend)
        if self.fp8_min_tokens is not None and input_ids.shape[0] >= self.fp8_min_tokens:
            return self.fp8_hidden_states(input_ids, attend)
        norms = [layer.attn_norm.weight for layer in self.layers[1:]] + [self.norm.weight]
        x, residual = ops.embed_rms_norm(input_ids, self.embed.weight, self.layers[0].attn_norm.weight, self.eps)
        for layer, next_norm in zip(self.layers, norms):
            attn = attend(layer, layer.qkv(x))
            x, residual = add_rms_norm(layer.o(attn), residual, layer.mlp_norm.weight, self.eps)
            # The next layer's input norm (or the final norm) takes this layer's residual add.
            x, residual = add_rms_norm(layer.down(silu_mul(layer.gate_up(x))), residual, next_norm, self.eps)
        return x

    @torch.no_grad()
    def after_load(self, options: EngineOptions) -> None:
        """Fold each pre-norm's weight into the product that reads it: rms_norm(x) * g @ W.T equals
        rms_norm(x) @ (W * g).T, so the query kernels can scale rows after the product
        (worker/kernels/skinny.py). The norms keep a weight of ones, so every path sees one model.
        options.fold_norms off keeps the checkpoint's weights as they are, and the query kernels off
        (they need the fold): for comparing numerics. The head, if any, takes its own rewrite."""
        self.head_after_load()
        self.folded = options.fold_norms
        self.query_kernels = self.folded and self.ops.skinny_linear is not None
        if not self.folded:
            return
        for layer in self.layers:
            for norm, linear in ((layer.attn_norm, layer.qkv), (layer.mlp_norm, layer.gate_up)):
                folded = linear.weight.float() * norm.weight.float()[None, :]
                linear.weight.copy_(folded.to(linear.weight.dtype))
                norm.weight.fill_(1.0)

    def after_quantize(self, min_tokens: int) -> None:
        """fp8 (worker/models/fp8.py): where every product of every layer is an Fp8Linear, batches
        from min_tokens on take fp8_hidden_states; else the products quantize their inputs alone."""
        products = [getattr(layer, name) for layer in self.layers for name in ("qkv", "o", "gate_up", "down")]
        if all(hasattr(p, "scaled") for p in products):
            self.fp8_min_tokens = min_tokens

    def fp8_hidden_states(self, input_ids: torch.Tensor, attend) -> torch.Tensor:
        """hidden_states with fp8 products: each norm and the SiLU-gate write their output in e4m3
        with its per-token scales for the product that reads it (Ops.*_fp8); the attention's output
        is quantized in a pass of its own by the o product (Fp8Linear.forward). The final norm's
        output, which pooling reads, stays in the model's dtype."""
        ops = self.ops
        norms = [layer.attn_norm.weight for layer in self.layers[1:]] + [self.norm.weight]
        x8, scale, residual = ops.embed_rms_norm_fp8(input_ids, self.embed.weight, self.layers[0].attn_norm.weight,
                                                     self.eps)
        last = len(self.layers) - 1
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            attn = attend(layer, layer.qkv.scaled(x8, scale))
            x8, scale, residual = ops.add_rms_norm_fp8(layer.o(attn), residual, layer.mlp_norm.weight, self.eps)
            down = layer.down.scaled(*ops.silu_mul_fp8(layer.gate_up.scaled(x8, scale)))
            if i < last:
                x8, scale, residual = ops.add_rms_norm_fp8(down, residual, next_norm, self.eps)
            else:
                x, _ = ops.add_rms_norm(down, residual, next_norm, self.eps)
        return x

    def fits_query_kernels(self, tokens: int) -> bool:
        """Whether a batch of `tokens` takes query_hidden_states: the model may (after_load), the
        products' shapes fit the skinny kernels, and the measured table says they win there."""
        if not self.query_kernels:
            return False
        first, fits = self.layers[0], self.ops.skinny_fits
        return (self.ops.skinny_layer_wins(self.embed.weight.shape[1], tokens)
                and fits(tokens, first.qkv.weight) and fits(tokens, first.o.weight)
                and fits(tokens, first.gate_up.weight, swiglu=True) and fits(tokens, first.down.weight))

    def attend(self, layer: Qwen3Layer, qkv: torch.Tensor, *, short: bool, cache: torch.Tensor,
               positions: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """QK-norm (where the layer has it), RoPE and attention from the fused projection
        qkv [T, (H + 2 KV) * D]: [T, H * D]."""
        q_norm, k_norm = (None, None) if layer.q_norm is None else (layer.q_norm.weight, layer.k_norm.weight)
        if short:
            attn = self.short_qk_rope_attention(qkv, q_norm, k_norm, cache, positions, layer.heads, layer.kv_heads,
                                                self.eps, cu_seqlens, max_seqlen, self.causal)
        else:
            q, k, v = self.ops.qk_norm_rope(qkv, q_norm, k_norm, cache, positions, layer.heads, layer.kv_heads,
                                            self.eps)
            attn = self.attention(q, k, v, cu_seqlens, max_seqlen, causal=self.causal)
        return attn.reshape(qkv.shape[0], -1)

    def query_hidden_states(self, input_ids: torch.Tensor, attend) -> torch.Tensor:
        """At most 64 tokens (queries): five kernels a layer instead of eight (worker/kernels/skinny.py).
        The o and down products write the residual stream and its per-row sums of squares; the qkv
        and gate/up products read it raw and apply the norm in their epilogue (its weight is folded
        in, see after_load), gate/up also SiLU-gate. `attend` is hidden_states' attention step."""
        ops, linear = self.ops, self.ops.skinny_linear
        x, residual = ops.embed_rms_norm(input_ids, self.embed.weight, self.layers[0].attn_norm.weight, self.eps)
        parts = None  # the first layer's input is normalized already
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            qkv = linear(x if parts is None else residual, layer.qkv.weight, layer.qkv.bias, parts=parts, eps=self.eps)
            residual, parts = linear(attend(layer, qkv), layer.o.weight, layer.o.bias, residual=residual)
            act = linear(residual, layer.gate_up.weight, parts=parts, eps=self.eps, swiglu=True)
            if i < last:
                residual, parts = linear(act, layer.down.weight, residual=residual)
            else:  # the final norm keeps its own weight (nothing reads it to fold it into)
                x, _ = ops.add_rms_norm(linear(act, layer.down.weight), residual, self.norm.weight, self.eps)
        return x

    def hf_weight_map(self) -> dict[str, list[str]]:
        m = self.head_weight_map()
        m |= {"embed.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
        for i, layer in enumerate(self.layers):
            ours, hf = f"layers.{i}.", f"layers.{i}."
            m[ours + "attn_norm.weight"] = [hf + "input_layernorm.weight"]
            m[ours + "mlp_norm.weight"] = [hf + "post_attention_layernorm.weight"]
            if layer.q_norm is not None:
                m[ours + "q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
                m[ours + "k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
            m[ours + "qkv.weight"] = [hf + f"self_attn.{n}_proj.weight" for n in "qkv"]
            m[ours + "o.weight"] = [hf + "self_attn.o_proj.weight"]
            if layer.qkv.bias is not None:
                m[ours + "qkv.bias"] = [hf + f"self_attn.{n}_proj.bias" for n in "qkv"]
            if layer.o.bias is not None:
                m[ours + "o.bias"] = [hf + "self_attn.o_proj.bias"]
            m[ours + "gate_up.weight"] = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
            m[ours + "down.weight"] = [hf + "mlp.down_proj.weight"]
        return m

