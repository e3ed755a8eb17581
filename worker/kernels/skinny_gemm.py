"""x @ W.T (+ b) for a handful of rows (a query's tokens): stream the weight once, at full width.

At 16..64 tokens a layer's matrix products read megabytes of weights for a few kilobytes of
activations, so they are bound by memory and by launch latency, not by arithmetic. Each program
owns BLOCK_N output columns for all rows and walks K in BLOCK_K steps, keeping several weight tiles
in flight (num_stages).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 64


@triton.jit
def _skinny_mm(x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, sx, sw, so,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xm = rm[:, None] < M
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * sx + (k + rk)[None, :], mask=xm, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * sw + (k + rk)[None, :])
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn)[None, :].to(tl.float32)
    tl.store(o_ptr + rm[:, None] * so + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=xm)


def fits(x: torch.Tensor, weight: torch.Tensor, block_n: int = 16, block_k: int = 128) -> bool:
    n, k = weight.shape
    return x.shape[0] <= MAX_ROWS and n % block_n == 0 and k % block_k == 0


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  block_n: int = 16, block_k: int = 128, stages: int = 4, warps: int = 4) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(m, n)
    block_m = max(16, triton.next_power_of_2(m))
    _skinny_mm[(n // block_n,)](x, weight, bias if bias is not None else weight, out, m, n, k,
                                x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                num_stages=stages, num_warps=warps)
    return out
