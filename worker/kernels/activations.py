"""SiLU(gate) * up (SwiGLU) and GELU(gate) * up (GeGLU) over the fused gate/up projection, in one
pass each (torch takes three kernels)."""
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


@triton.jit
def _gelu_mul(gu_ptr, out_ptr, inter, TANH: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g_raw = tl.load(gu_ptr + t * 2 * inter + cols, mask=mask, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(gu_ptr + t * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if TANH:  # tanh(y) = 2 sigmoid(2y) - 1
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:
        act = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    # Round where torch rounds: gelu's result to the model dtype, then the product.
    tl.store(out_ptr + t * inter + cols, (act.to(g_raw.dtype).to(tl.float32) * u).to(g_raw.dtype), mask=mask)


def gelu_mul(gate_up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    gate_up = gate_up.contiguous()
    tokens, width = gate_up.shape
    inter = width // 2
    out = gate_up.new_empty(tokens, inter)
    block = 1024
    _gelu_mul[(tokens, triton.cdiv(inter, block))](gate_up, out, inter, TANH=approximate == "tanh", BLOCK=block,
                                                   num_warps=4)
    return out
