"""QK-norm + RoPE in one kernel per token: splits the fused QKV projection into contiguous q, k
and v, RMS-normalizes every q and k head with its weight, and rotates both by the token's
position (halves form, cos/sin from a float32 cache). Replaces about a dozen small torch ops.
Without QK-norm (weights None, NORM false: Qwen2, Mistral, Llama, ModernBERT) the same kernel
only splits and rotates."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope(qkv_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cache_ptr, pos_ptr, eps,
                  HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    ALL: tl.constexpr = HEADS + 2 * KV
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, HALF)[None, :]
    valid = h < ALL
    base = qkv_ptr + t * (ALL * D) + h * D
    a_raw = tl.load(base + c, mask=valid, other=0.0)
    b_raw = tl.load(base + HALF + c, mask=valid, other=0.0)
    dt = a_raw.dtype
    a = a_raw.to(tl.float32)
    b = b_raw.to(tl.float32)
    is_q = h < HEADS
    if NORM:
        rstd = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D + eps)[:, None]
        a = (a * rstd).to(dt).to(tl.float32)
        b = (b * rstd).to(dt).to(tl.float32)
        wa = tl.where(is_q, tl.load(qw_ptr + c).to(tl.float32), tl.load(kw_ptr + c).to(tl.float32))
        wb = tl.where(is_q, tl.load(qw_ptr + HALF + c).to(tl.float32), tl.load(kw_ptr + HALF + c).to(tl.float32))
        a = (wa * a).to(dt).to(tl.float32)
        b = (wb * b).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cache_ptr + pos * D + c)
    sin = tl.load(cache_ptr + pos * D + HALF + c)
    ra = (a * cos - b * sin).to(dt)
    rb = (b * cos + a * sin).to(dt)
    q_rows = q_ptr + t * (HEADS * D) + h * D
    tl.store(q_rows + c, ra, mask=is_q)
    tl.store(q_rows + HALF + c, rb, mask=is_q)
    is_k = (h >= HEADS) & (h < HEADS + KV)
    k_rows = k_ptr + t * (KV * D) + (h - HEADS) * D
    tl.store(k_rows + c, ra, mask=is_k)
    tl.store(k_rows + HALF + c, rb, mask=is_k)
    is_v = (h >= HEADS + KV) & valid
    v_rows = v_ptr + t * (KV * D) + (h - HEADS - KV) * D
    tl.store(v_rows + c, a_raw, mask=is_v)
    tl.store(v_rows + HALF + c, b_raw, mask=is_v)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cache: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, eps: float):
    """worker/models/ops.py's qk_norm_rope: weights None skip the norm (the kernel is told so and
    reads no weight; qkv stands in for the pointers)."""
    qkv = qkv.contiguous()
    tokens = qkv.shape[0]
    d = cache.shape[1]
    norm = q_weight is not None
    q = qkv.new_empty(tokens, heads, d)
    k = qkv.new_empty(tokens, kv_heads, d)
    v = qkv.new_empty(tokens, kv_heads, d)
    _qk_norm_rope[(tokens,)](qkv, q, k, v, q_weight if norm else qkv, k_weight if norm else qkv, cache, positions,
                             eps, HEADS=heads, KV=kv_heads, D=d, BLOCK_H=triton.next_power_of_2(heads + 2 * kv_heads),
                             NORM=norm, num_warps=4)
    return q, k, v
