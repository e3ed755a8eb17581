"""SiLU(gate) * up over the fused gate/up projection, in one pass (torch takes three kernels)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g_raw = tl.load(gu_ptr + t * 2 * inter + cols, mask=mask, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(gu_ptr + t * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # Round where torch rounds: silu's result to the model dtype, then the product.
    s = (g * tl.sigmoid(g)).to(g_raw.dtype).to(tl.float32)
    tl.store(out_ptr + t * inter + cols, (s * u).to(g_raw.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    tokens, width = gate_up.shape
    inter = width // 2
    out = gate_up.new_empty(tokens, inter)
    block = 1024
    _silu_mul[(tokens, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
