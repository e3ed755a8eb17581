"""Residual add + RMSNorm in one pass: each token's row is read once, the sum and the normalized
row written once. Rounds exactly where worker/models/ops.py's reference (and HF) rounds: the sum to
the model dtype, the normalized value to the model dtype, then the product with the weight."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_cols, eps,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * n_cols + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    x = x.contiguous()
    rows, cols = x.shape
    y = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(cols)
    _add_rms_norm[(rows,)](x, residual if residual is not None else x, weight, y, summed, cols, eps,
                           HAS_RESIDUAL=residual is not None, BLOCK=block,
                           num_warps=min(max(block // 256, 1), 8))
    return y, summed
