"""Matrix products for query-sized batches (at most 64 tokens), with the pre-norm folded in.

At 16..64 tokens a layer is a chain of small dependent kernels whose cost is their launch and
ramp-up, not their work (docs/gpu-notes.md). These kernels take two of those costs away:

* The pre-norm block "residual += h; x = rms_norm(residual) * g; y = x @ W.T" is one kernel:

      y[m, n] = rstd[m] * sum_k (residual[m, k] * g[k]) * W[n, k]

  rstd[m] is a per-row scalar, so it can wait until after the reduction. Every program sums the
  squares of its rows while it streams K (the rows are tiny next to its weight tiles), so no
  program waits for another; program 0 also writes the new residual. The first layer gathers its
  rows from the embedding table instead (the residual is then that gathered row).
* With SWIGLU, each program computes matching gate and up tiles and writes silu(gate) * up, so the
  activation kernel goes as well.
* With PDL (programmatic dependent launch), a kernel may start while the previous one finishes:
  it pulls its weight slice into L2 first (weights never depend on the previous kernel), then
  waits for the previous kernel's results (`gdc_wait`), and at its own start lets the next kernel
  launch (`gdc_launch_dependents`). The chain of kernels then overlaps its ramp-ups.

Rounding: the normalized row is rounded once, after the weight g and before the product (HF
rounds it before g and after); one bf16 step of the product's input, which
tests/test_cuda_engine.py bounds against the two-kernel reference.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (Triton 3.3 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: the PDL branch is never compiled (pdl_on() is False)
    gdc_launch_dependents = gdc_wait = None

MAX_ROWS = 64  # batches of up to this many tokens take these kernels (one row block: tl.dot's M)

# The previous kernel's results: what a program must not read before gdc_wait.
NORM_NONE, NORM_ADD, NORM_GATHER = 0, 1, 2


@triton.jit
def _prefetch_l2(ptrs):
    # One L2 prefetch per element pointer; is_pure=False keeps it although its value is unused.
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _skinny_linear(h_ptr, r_ptr, ids_ptr, g_ptr, w_ptr, b_ptr, y_ptr, s_ptr, M, N, K: tl.constexpr, eps,
                   NORM: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:
        # Let the next kernel start launching, pull our weight slice (and the up half's) into L2 one
        # 128-byte line at a time, and only then wait for the previous kernel's results.
        gdc_launch_dependents()
        for k0 in tl.static_range(0, K, 64 * 16):
            cols = tl.minimum(k0 + tl.arange(0, 16) * 64, K - 64)  # past the end: the last line again
            line_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + cols[None, :]
            _prefetch_l2(line_ptrs)
            if SWIGLU:
                _prefetch_l2(line_ptrs + N * K)
        gdc_wait()
    if NORM == 2:  # rows of the embedding table
        src = tl.load(ids_ptr + rm, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rm.to(tl.int64)
    residual_rows = tl.where(pid == 0, M, 0)  # program 0 writes the new residual
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x = tl.load(h_ptr + src[:, None] * K + rk[None, :], mask=row_ok[:, None], other=0.0)
        if NORM != 0:
            if NORM == 1:  # the residual add, rounded to the model dtype as the reference rounds it
                r = tl.load(r_ptr + rm[:, None] * K + rk[None, :], mask=row_ok[:, None], other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + rm[:, None] * K + rk[None, :], x, mask=rm[:, None] < residual_rows)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            x = (xf * tl.load(g_ptr + rk).to(tl.float32)[None, :]).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :])
        acc += tl.dot(x, tl.trans(w))
        if SWIGLU:
            w_up = tl.load(w_ptr + (rn + N)[:, None].to(tl.int64) * K + rk[None, :])
            acc_up += tl.dot(x, tl.trans(w_up))
    if NORM != 0:
        rstd = tl.rsqrt(squares / K + eps)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    if SWIGLU:
        # Round where the reference rounds: each projection, silu's result, then the product.
        dt = y_ptr.dtype.element_ty
        gate = acc.to(dt).to(tl.float32)
        acc = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) by (swiglu, K); see load/bench_skinny_linear.py.
CONFIGS: dict[tuple[bool, int], tuple[int, int, int, int]] = {}
DEFAULT_CONFIG = (16, 128, 4, 4)


def load_configs(path: str) -> None:
    """Take the table a run of load/bench_skinny_linear.py wrote (POLLEN_SKINNY_CONFIGS=PATH)."""
    import json

    with open(path) as f:
        for key, config in json.load(f)["configs"].items():
            kind, k = key.split(",")
            CONFIGS[(kind == "swiglu", int(k))] = tuple(config)


if os.environ.get("POLLEN_SKINNY_CONFIGS"):
    load_configs(os.environ["POLLEN_SKINNY_CONFIGS"])


def pdl_on() -> bool:
    """Programmatic dependent launch for the query kernels: POLLEN_PDL=1 (the default) where this
    Triton has it; 0 turns it off (debugging, or a driver that rejects it)."""
    return gdc_wait is not None and os.environ.get("POLLEN_PDL", "1") != "0"


def pdl_launch(pdl: bool | None = None) -> dict:
    """The launch options (and the PDL constexpr) of a kernel that takes part in the PDL chain."""
    pdl = pdl_on() if pdl is None else pdl
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def config_for(swiglu: bool, k: int) -> tuple[int, int, int, int]:
    block_n, block_k, warps, stages = CONFIGS.get((swiglu, k), DEFAULT_CONFIG)
    while k % block_k:  # a K step that divides K (fits() asks for K % 64 == 0)
        block_k //= 2
    return block_n, block_k, warps, stages


def fits(tokens: int, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """Whether a [tokens, K] @ weight.T product takes these kernels."""
    n, k = weight.shape
    n = n // 2 if swiglu else n
    return (tokens <= MAX_ROWS and n % config_for(swiglu, k)[0] == 0 and k % 64 == 0
            and weight.dtype in (torch.bfloat16, torch.float16))


def skinny_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  residual: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
                  config=None, pdl: bool | None = None):
    """y = f(x) @ weight.T (+ bias), for up to MAX_ROWS rows; returns (y, new_residual).

    norm_weight None: x is h, and new_residual is None.
    norm_weight set: x = rms_norm(h + residual) * norm_weight, new_residual = h + residual
      (residual None: x = rms_norm(h)); with `ids`, h is the embedding table and x its rows ids.
    swiglu: weight is [gate; up] (2I rows) and y = silu(x @ gate.T) * (x @ up.T), [rows, I].
    """
    if ids is not None:
        m, k, mode = ids.shape[0], h.shape[1], NORM_GATHER
    else:
        h = h.contiguous()
        m, k = h.shape
        mode = NORM_NONE if norm_weight is None else NORM_ADD if residual is not None else NORM_GATHER
        if mode == NORM_GATHER:  # a norm without a residual: gather every row of h in order
            ids = torch.arange(m, device=h.device, dtype=torch.int32)
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    block_n, block_k, warps, stages = config or config_for(swiglu, k)
    y = h.new_empty(m, n)
    summed = h.new_empty(m, k) if mode != NORM_NONE else y
    _skinny_linear[(n // block_n,)](
        h, residual if residual is not None else h, ids if ids is not None else h,
        norm_weight if norm_weight is not None else h, weight, bias if bias is not None else h, y, summed,
        m, n, k, eps, NORM=mode, SWIGLU=swiglu, HAS_BIAS=bias is not None,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages, **pdl_launch(pdl))
    return y, (summed if mode != NORM_NONE else None)
