"""Per-token e4m3 quantization for the fp8 products (worker/models/fp8.py): a row alone, and SiLU(gate)
* up quantized as it is made, so the down product's input is never written in bfloat16.

A row's scale is max|row| / 448 over the whole row, which a program sees in blocks: the first loop
takes the amax, the second writes the quantized row. The second pass reads what the first just
read, from cache (a row of the widest intermediate is 24 KiB of bfloat16). Both quantize exactly
the values worker/models/ops.py's references do: SiLU's result rounded to the model dtype, the
product rounded again, then divided by the scale.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pollen.worker.models.ops import AMAX_FLOOR as AMAX_FLOOR_VALUE
from pollen.worker.models.ops import E4M3
from pollen.worker.models.ops import E4M3_MAX as E4M3_MAX_VALUE

# ops.AMAX_FLOOR and ops.E4M3_MAX as Triton constants (norms.py's fp8 forms use them too).
AMAX_FLOOR: tl.constexpr = tl.constexpr(AMAX_FLOOR_VALUE)
E4M3_MAX: tl.constexpr = tl.constexpr(E4M3_MAX_VALUE)
BLOCK = 1024


@triton.jit
def _value(x_ptr, row, cols, mask, n_cols, SILU: tl.constexpr):
    """A block of the row to quantize, float32: x itself, or with SILU silu(gate) * up read from the
    fused gate/up row of 2 * n_cols (rounded where torch rounds: silu's result, then the product)."""
    if SILU:
        g_raw = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
        g = g_raw.to(tl.float32)
        u = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(g_raw.dtype).to(tl.float32)
        return (s * u).to(g_raw.dtype).to(tl.float32)
    return tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize(x_ptr, q_ptr, scale_ptr, n_cols, SILU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_value(x_ptr, row, cols, cols < n_cols, n_cols, SILU)))
    scale = tl.maximum(tl.max(amax, axis=0), AMAX_FLOOR) / E4M3_MAX
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = _value(x_ptr, row, cols, mask, n_cols, SILU)
        tl.store(q_ptr + row * n_cols + cols, (v / scale).to(q_ptr.dtype.element_ty), mask=mask)


def silu_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 2I] (gate then up) -> (e4m3 silu(gate) * up [T, I], float32 scales [T, 1])."""
    gate_up = gate_up.contiguous()
    return _quantized(gate_up, gate_up.shape[1] // 2, silu=True)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] -> (e4m3 [T, K], float32 scales [T, 1]), each row by its own max|row| / 448."""
    x = x.contiguous()
    return _quantized(x, x.shape[1], silu=False)


def _quantized(x: torch.Tensor, cols: int, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    out = torch.empty(rows, cols, device=x.device, dtype=E4M3)
    scales = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    _quantize[(rows,)](x, out, scales, cols, SILU=silu, BLOCK=BLOCK, num_warps=4)
    return out, scales
