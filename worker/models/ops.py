"""The element-wise pieces of the transformer layers, and `Ops`: the implementations one model runs.

Each function here is the plain-torch reference. The loader chooses a model's `Ops` once
(worker/models/loader.py, `choose_ops`): these references, or on CUDA, when Triton is importable
and EngineOptions.triton is on, the fused kernels of worker/kernels/: one launch for residual-add +
RMSNorm, one for (QK-norm +) RoPE, one for SiLU-gate or GeGLU, and the kernels that have no reference here
(short-sequence attention, the query products). A short query is bound by kernel launches, so
every launch saved is latency saved. The references compute in float32
and round once, like the kernels, so both agree to rounding.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # HF Qwen3RMSNorm rounds the normalized value to the input dtype, then scales by the weight.
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the pre-norm block's two outputs (no add if None)."""
    summed = x if residual is None else x + residual
    return rms_norm(summed, weight, eps), summed


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(table[ids]), table[ids]): embedding lookup and the first layer's input norm."""
    return add_rms_norm(F.embedding(ids, table), None, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up, as the fused projection lays them out) -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# fp8 (worker/models/fp8.py): e4m3's largest value; an all-zero row's amax is taken as at least
# AMAX_FLOOR so that its scale never divides by 0 (its quantized row is 0 either way).
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] -> (e4m3 [T, K], float32 [T, 1]): each token's row by its own scale max|row| / 448."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_FLOOR) / E4M3_MAX
    return (xf / scale).to(E4M3), scale


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(e4m3 rms_norm(x + residual), its scales, x + residual): add_rms_norm with its output
    quantized for the fp8 product that reads it."""
    y, summed = add_rms_norm(x, residual, weight, eps)
    return *quantize_rows(y), summed


def embed_rms_norm_fp8(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    """embed_rms_norm with its normalized output quantized: (e4m3, scales, table[ids])."""
    y, gathered = embed_rms_norm(ids, table, weight, eps)
    return *quantize_rows(y), gathered


def silu_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul quantized for the down product: (e4m3 [T, I], scales [T, 1])."""
    return quantize_rows(silu_mul(gate_up))


def rope_inv_freq(theta: float, head_dim: int, scaling: dict | None = None) -> torch.Tensor:
    """float32 [head_dim / 2]: RoPE's frequencies theta^(-2i / head_dim), as `scaling` (a config's
    rope_parameters, common/model_spec.py) changes them: "linear" divides them all by its factor;
    "llama3" divides the low ones (wavelengths past original / low_freq_factor) by its factor,
    keeps the high ones (below original / high_freq_factor) and blends between the two."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        original = float(scaling["original_max_position_embeddings"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        between = (wavelength >= original / high) & (wavelength <= original / low)
        return torch.where(between, blended, scaled)
    raise ValueError(f"RoPE type {kind!r} is not implemented (common/model_spec.py refuses it). This is a bug.")


def rope_cache(theta: float, head_dim: int, max_positions: int, device, scaling: dict | None = None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each frequency in the first half, sin in the second."""
    inv_freq = rope_inv_freq(theta, head_dim, scaling).to(device)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cache: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, eps: float):
    """Split the fused projection, RMS-normalize each q and k head (QK-norm; weights None: a model
    without it), rotate both (RoPE, halves form).

    qkv [T, (heads + 2 * kv_heads) * D] -> q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, D];
    D is the cache's width.
    """
    tokens = qkv.shape[0]
    head_dim = cache.shape[1]
    q, k, v = qkv.view(tokens, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    cos_sin = cache[positions.long()]  # [T, D]
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        x = (x if weight is None else rms_norm(x, weight, eps)).float()
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(qkv.dtype)

    return rotate(q, q_weight), rotate(k, k_weight), v


def gelu_mul(gate_up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU: [T, 2I] (gated half first, as ModernBERT's Wi lays them out) -> gelu(first) * second,
    [T, I]. approximate "none" is the exact erf form (HF "gelu"), "tanh" the tanh approximation."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


@dataclasses.dataclass(frozen=True, slots=True)
class Ops:
    """One model's implementations, chosen when it is loaded; the forward calls them, never asks.

    The five element-wise ones take and give the same tensors in either set. The Triton-only
    kernels are None in the torch set, and None in the Triton set where EngineOptions turned
    them off: a model takes a kernel exactly when it is here and the batch's shape fits it.
    """

    name: str  # "torch" or "triton"
    attention: str  # the varlen kernel (worker/models/attention.py, backend): flash_attn, torch_varlen, sdpa_loop
    add_rms_norm: Callable
    embed_rms_norm: Callable
    qk_norm_rope: Callable
    silu_mul: Callable
    gelu_mul: Callable
    # Sequences of up to kernels.SHORT_MAX_LEN tokens: attention of packed q, k, v, and Qwen3's
    # QK-norm + RoPE + attention in one kernel (worker/kernels/short_attention.py).
    short_attention: Callable | None = None
    short_qk_rope_attention: Callable | None = None
    # Batches of up to 64 tokens: the products that take over the element-wise work around them
    # (worker/kernels/skinny.py: skinny_linear, fits, layer_wins).
    skinny_linear: Callable | None = None
    skinny_fits: Callable | None = None
    skinny_layer_wins: Callable | None = None
    # MPNet's attention with its relative-position bias over packed sequences
    # (worker/kernels/relative_attention.py; worker/models/relative_position.py uses it).
    relative_attention: Callable | None = None
    # fp8 products (worker/models/fp8.py): per-token quantization alone, and fused into the kernel
    # that makes a product's input. Either set has them; the Triton one writes the fp8 row in the
    # same pass as the value (worker/kernels/quant.py).
    quantize_rows: Callable = quantize_rows
    add_rms_norm_fp8: Callable = add_rms_norm_fp8
    embed_rms_norm_fp8: Callable = embed_rms_norm_fp8
    silu_mul_fp8: Callable = silu_mul_fp8


def reference_ops(attention: str) -> Ops:
    """The torch references, with the given attention kernel."""
    return Ops("torch", attention, add_rms_norm, embed_rms_norm, qk_norm_rope, silu_mul, gelu_mul)
