"""Attention for batches whose sequences are all short (queries): one program per (sequence, head)
holds the whole sequence in registers, so a 16-token query costs one small kernel in each layer
instead of a flash-attention launch sized for long sequences.

Same contract as worker/models/attention.py: packed q [T, H, D], k/v [T, KV, D] (GQA when KV < H),
int32 cu_seqlens, causal or not. Sequences longer than BLOCK are only computed for their first
BLOCK rows, so the caller uses it only when max_seqlen <= BLOCK (the CUDA engine's padding
sequence may be longer; its rows are discarded anyway).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_times_v(s, v, live, m, CAUSAL: tl.constexpr):
    """softmax(s) @ v over one sequence's scores s [BLOCK, BLOCK], keys limited to the live rows
    (and to the past when causal). Rows past the sequence come out as garbage the caller masks."""
    allowed = live[None, :]
    if CAUSAL:
        allowed = allowed & (m[None, :] <= m[:, None])
    s = tl.where(allowed, s, float("-inf"))
    p = tl.exp(s - tl.max(s, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    return tl.dot(p.to(v.dtype), v)


@triton.jit
def _short_attention(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, sq, sqh, sk, skh, sv, svh, so, soh, scale,
                     GROUP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, CAUSAL: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    start = tl.load(cu_ptr + seq).to(tl.int64)
    n = tl.load(cu_ptr + seq + 1).to(tl.int64) - start
    m = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    rows = start + m
    live = m < n
    q = tl.load(q_ptr + rows[:, None] * sq + h * sqh + d[None, :], mask=live[:, None], other=0.0)
    k = tl.load(k_ptr + rows[:, None] * sk + kvh * skh + d[None, :], mask=live[:, None], other=0.0)
    v = tl.load(v_ptr + rows[:, None] * sv + kvh * svh + d[None, :], mask=live[:, None], other=0.0)
    o = _softmax_times_v(tl.dot(q, tl.trans(k)) * scale, v, live, m, CAUSAL)
    tl.store(o_ptr + rows[:, None] * so + h * soh + d[None, :], o.to(o_ptr.dtype.element_ty), mask=live[:, None])


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    max_seqlen: int, causal: bool) -> torch.Tensor:
    tokens, heads, d = q.shape
    out = torch.empty(tokens, heads, d, dtype=q.dtype, device=q.device)
    block = max(16, triton.next_power_of_2(max_seqlen))
    grid = (cu_seqlens.shape[0] - 1, heads)
    _short_attention[grid](q, k, v, out, cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           v.stride(0), v.stride(1), out.stride(0), out.stride(1), d ** -0.5,
                           GROUP=heads // k.shape[1], D=d, BLOCK=block, CAUSAL=causal, num_warps=4)
    return out


@triton.jit
def _norm_rope(a, b, w_ptr, cos, sin, eps, D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """RMSNorm with weight (NORM), then RoPE, on a [BLOCK, D] tile held as halves a, b (float32 in
    and out), rounding where worker/models/ops.py's qk_norm_rope rounds. w_ptr's dtype is the
    model's (without NORM the caller passes the qkv pointer, never read)."""
    dt = w_ptr.dtype.element_ty
    if NORM:
        c = tl.arange(0, HALF)[None, :]
        rstd = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D + eps)[:, None]
        a = (a * rstd).to(dt).to(tl.float32)
        b = (b * rstd).to(dt).to(tl.float32)
        a = (tl.load(w_ptr + c).to(tl.float32) * a).to(dt).to(tl.float32)
        b = (tl.load(w_ptr + HALF + c).to(tl.float32) * b).to(dt).to(tl.float32)
    return (a * cos - b * sin).to(dt), (b * cos + a * sin).to(dt)


@triton.jit
def _short_qk_rope_attention(qkv_ptr, o_ptr, cu_ptr, pos_ptr, qw_ptr, kw_ptr, cache_ptr, eps, scale,
                             HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                             CAUSAL: tl.constexpr, NORM: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (HEADS // KV)
    HALF: tl.constexpr = D // 2
    ALL: tl.constexpr = HEADS + 2 * KV
    start = tl.load(cu_ptr + seq).to(tl.int64)
    n = tl.load(cu_ptr + seq + 1).to(tl.int64) - start
    m = tl.arange(0, BLOCK)
    c = tl.arange(0, HALF)[None, :]
    live = m < n
    rows = qkv_ptr + (start + m)[:, None] * (ALL * D)
    lm = live[:, None]
    pos = tl.load(pos_ptr + start + m, mask=live, other=0).to(tl.int64)[:, None]
    cos = tl.load(cache_ptr + pos * D + c)
    sin = tl.load(cache_ptr + pos * D + HALF + c)
    qa = tl.load(rows + h * D + c, mask=lm, other=0.0).to(tl.float32)
    qb = tl.load(rows + h * D + HALF + c, mask=lm, other=0.0).to(tl.float32)
    ka = tl.load(rows + (HEADS + kvh) * D + c, mask=lm, other=0.0).to(tl.float32)
    kb = tl.load(rows + (HEADS + kvh) * D + HALF + c, mask=lm, other=0.0).to(tl.float32)
    v = tl.load(rows + (HEADS + KV + kvh) * D + tl.arange(0, D)[None, :], mask=lm, other=0.0)
    qa, qb = _norm_rope(qa, qb, qw_ptr, cos, sin, eps, D, HALF, NORM)
    ka, kb = _norm_rope(ka, kb, kw_ptr, cos, sin, eps, D, HALF, NORM)
    o = _softmax_times_v((tl.dot(qa, tl.trans(ka)) + tl.dot(qb, tl.trans(kb))) * scale, v, live, m, CAUSAL)
    out = o_ptr + (start + m)[:, None] * (HEADS * D) + h * D + tl.arange(0, D)[None, :]
    tl.store(out, o.to(o_ptr.dtype.element_ty), mask=lm)


def short_qk_rope_attention(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                            cache: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, eps: float,
                            cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool) -> torch.Tensor:
    """The decoders' QK-norm (weights None: none) + RoPE + attention for short sequences in one
    kernel: reads the fused QKV projection [T, (H + 2 KV) * D] directly and writes the attention
    output [T, H, D]."""
    qkv = qkv.contiguous()
    d = cache.shape[1]
    norm = q_weight is not None
    out = qkv.new_empty(qkv.shape[0], heads, d)
    block = max(16, triton.next_power_of_2(max_seqlen))
    _short_qk_rope_attention[(cu_seqlens.shape[0] - 1, heads)](
        qkv, out, cu_seqlens, positions, q_weight if norm else qkv, k_weight if norm else qkv, cache, eps,
        d ** -0.5, HEADS=heads, KV=kv_heads, D=d, BLOCK=block, CAUSAL=causal, NORM=norm, num_warps=4)
    return out
