"""Residual add + RMSNorm in one pass: each token's row is read once, the sum and the normalized
row written once. Rounds exactly where worker/models/ops.py's reference (and HF) rounds: the sum to
the model dtype, the normalized value to the model dtype, then the product with the weight.

The *_fp8 forms write the normalized row in e4m3 with its per-token scale instead (for the fp8
product that reads it, worker/models/fp8.py): the row is in registers already, so its amax and the
quantization cost no pass of their own."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pollen.worker.kernels.quant import AMAX_FLOOR, E4M3_MAX
from pollen.worker.models.ops import E4M3


@triton.jit
def _add_rms_norm(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, ids_ptr, q_scale_ptr, n_cols, eps,
                  HAS_RESIDUAL: tl.constexpr, GATHER: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr):
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
    dtype = s_ptr.dtype.element_ty  # the model's (y's too, unless QUANT)
    normed = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (w * normed).to(dtype)
    if QUANT:  # as ops.quantize_rows: the rounded row by its own scale max|row| / 448
        o = out.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(o), axis=0), AMAX_FLOOR) / E4M3_MAX
        tl.store(q_scale_ptr + row, scale)
        tl.store(y_ptr + row * n_cols + cols, (o / scale).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + row * n_cols + cols, out, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    y, _, summed = _launch(x.contiguous(), residual, None, weight, eps, quant=False)
    return y, summed


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(e4m3 rms_norm(x + residual), float32 scales [T, 1], x + residual)."""
    return _launch(x.contiguous(), residual, None, weight, eps, quant=True)


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(table[ids]), table[ids]): the embedding lookup fused into the first layer's norm."""
    y, _, gathered = _launch(table, None, ids, weight, eps, quant=False)
    return y, gathered


def embed_rms_norm_fp8(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float):
    """(e4m3 rms_norm(table[ids]), float32 scales [T, 1], table[ids])."""
    return _launch(table, None, ids, weight, eps, quant=True)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, ids: torch.Tensor | None, weight: torch.Tensor,
            eps: float, quant: bool):
    """(normalized rows, their scales if `quant` else None, the summed or gathered rows): x's rows,
    or with `ids` the rows of the table x that they name."""
    rows, cols = (ids.shape[0] if ids is not None else x.shape[0]), x.shape[1]
    y = torch.empty(rows, cols, device=x.device, dtype=E4M3 if quant else x.dtype)
    scales = torch.empty(rows, 1, device=x.device, dtype=torch.float32) if quant else y
    summed = x.new_empty(rows, cols) if residual is not None or ids is not None else x
    block = triton.next_power_of_2(cols)
    _add_rms_norm[(rows,)](x, residual if residual is not None else x, weight, y, summed,
                           ids if ids is not None else x, scales, cols, eps,
                           HAS_RESIDUAL=residual is not None, GATHER=ids is not None, QUANT=quant, BLOCK=block,
                           num_warps=min(max(block // 256, 1), 8))
    return y, scales if quant else None, summed
