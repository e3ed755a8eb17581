"""Residual add + RMSNorm in one pass: each token's row is read once, the sum and the normalized
row written once. Rounds exactly where worker/models/ops.py's reference (and HF) rounds: the sum to
the model dtype, the normalized value to the model dtype, then the product with the weight."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, ids_ptr, n_cols, eps,
                  HAS_RESIDUAL: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if GATHER:  # x is an embedding table: this token's row of it, also written out as the residual
        src = tl.load(ids_ptr + row).to(tl.int64)
        raw = tl.load(x_ptr + src * n_cols + cols, mask=mask, other=0.0)
        tl.store(s_ptr + row * n_cols + cols, raw, mask=mask)
        x = raw.to(tl.float32)
    else:
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
    _add_rms_norm[(rows,)](x, residual if residual is not None else x, weight, y, summed, x, cols, eps,
                           HAS_RESIDUAL=residual is not None, GATHER=False, BLOCK=block,
                           num_warps=min(max(block // 256, 1), 8))
    return y, summed


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(table[ids]), table[ids]): the embedding lookup fused into the first layer's norm."""
    cols = table.shape[1]
    rows = ids.shape[0]
    y = table.new_empty(rows, cols)
    gathered = table.new_empty(rows, cols)
    block = triton.next_power_of_2(cols)
    _add_rms_norm[(rows,)](table, table, weight, y, gathered, ids, cols, eps,
                           HAS_RESIDUAL=False, GATHER=True, BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return y, gathered
