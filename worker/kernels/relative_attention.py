"""Flash attention with MPNet's relative-position bias over packed sequences (forward only).

The contract of worker/models/relative_position.py: packed q, k, v [T, H, D] (strided views of
the fused projection are fine; the last axis must be contiguous), int32 cu_seqlens, and the bias
as a float32 table [H, 2 * max_distance + 1] indexed by (key - query) clamped to ±max_distance.
Bidirectional, no GQA (MPNet has neither).

One program per (sequence, block of BLOCK_M queries, head) walks that sequence's keys BLOCK_N at a
time with the online softmax, adding the table's bias to each score. The grid is sized from
cu_seqlens' length and the host int max_seqlen, never from cu_seqlens' values, so the launch
needs no host sync and captures into a CUDA graph; programs whose block starts past their
sequence's end return at once. A sequence longer than max_seqlen (the CUDA engine's padding
sequence) has its queries past the grid's blocks left unwritten: the caller discards those rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _relative_attention(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, table_ptr, sq, sqh, sk, skh, sv, svh, so, soh,
                        scale, D: tl.constexpr, DP: tl.constexpr, MAX_DISTANCE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M
    h = tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - start
    if first >= n:
        return
    base = start.to(tl.int64)
    m = first + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DP)
    q_live = (m < n)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + (base + m)[:, None] * sq + h * sqh + d[None, :], mask=q_live, other=0.0)
    table = table_ptr + h * (2 * MAX_DISTANCE + 1) + MAX_DISTANCE
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    for key in range(0, n, BLOCK_N):
        j = key + tl.arange(0, BLOCK_N)
        kv_live = (j < n)[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + (base + j)[:, None] * sk + h * skh + d[None, :], mask=kv_live, other=0.0)
        v = tl.load(v_ptr + (base + j)[:, None] * sv + h * svh + d[None, :], mask=kv_live, other=0.0)
        relative = tl.minimum(tl.maximum(j[None, :] - m[:, None], -MAX_DISTANCE), MAX_DISTANCE)
        # Scores in base 2 (times log2(e)): exp2 is the hardware's exponential.
        s = (tl.dot(q, tl.trans(k)) * scale + tl.load(table + relative)) * 1.4426950408889634
        s = tl.where((j < n)[None, :], s, float("-inf"))
        # Every key block holds at least one live key, so `top` is finite and no row sees -inf - -inf.
        top = tl.maximum(best, tl.max(s, axis=1))
        p = tl.exp2(s - top[:, None])
        shrink = tl.exp2(best - top)
        total = total * shrink + tl.sum(p, axis=1)
        acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v)
        best = top
    out = acc / total[:, None]
    tl.store(o_ptr + (base + m)[:, None] * so + h * soh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_live)


def relative_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_seqlen: int, table: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + table[h, clamp(j - i)]) v per packed sequence -> [T, H, D] in q's dtype."""
    tokens, heads, d = q.shape
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise AssertionError("relative_attention wants q, k and v contiguous along D. This is a bug.")
    out = q.new_empty(tokens, heads, d)
    span = table.shape[1]
    grid = (cu_seqlens.shape[0] - 1, triton.cdiv(max(max_seqlen, 1), BLOCK_M), heads)
    _relative_attention[grid](q, k, v, out, cu_seqlens, table, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              v.stride(0), v.stride(1), out.stride(0), out.stride(1), d ** -0.5,
                              D=d, DP=max(16, triton.next_power_of_2(d)), MAX_DISTANCE=(span - 1) // 2,
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4, num_stages=2)
    return out
