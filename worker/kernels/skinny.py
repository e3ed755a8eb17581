"""Matrix products for query-sized batches (at most 64 tokens) that also do the work around them.

At 16..64 tokens a layer is a chain of small dependent kernels whose cost is their launch and
ramp-up, not their work. Each kernel here is one product y = x @ W.T (+ b)
in which every program owns BLOCK_N output columns for all rows and streams its weight slice once.
Around that product it takes over the element-wise kernels of a pre-norm layer:

* RESIDUAL (the o and down products): instead of y, write the new residual r + y, and for each
  row the sum of squares of this program's columns of it (one float per program and row, so no
  atomics and the result is the same bit for bit on every run).
* PARTS > 0 (the qkv and gate/up products, which read that residual): the RMSNorm. Its weight is
  folded into W at load time (worker/models/qwen3.py), and rstd is a per-row scalar, so

      rms_norm(r) * g @ W.T = rstd * (r @ (W * g).T),  rstd = rsqrt(sum of the PARTS partial sums / K + eps)

  is the product of the raw residual, scaled in the epilogue. No program repeats another's work.
* SWIGLU (gate/up): each program computes matching gate and up tiles and writes silu(gate) * up.

A layer is then five kernels (qkv, attention, o, gate/up, down) instead of eight. Rounding: the
normalized row is not rounded before the product (HF rounds it twice, before and after the norm
weight) and the folded weight is rounded once; both are within one bf16 step of the product's input.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pollen.worker.kernels.skinny_configs import MEASURED

MAX_ROWS = 64  # batches of up to this many tokens take these kernels (one row block: tl.dot's M)


@triton.jit
def _skinny_linear(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, parts_in_ptr, parts_out_ptr, ws_ptr, count_ptr,
                   M, N, K: tl.constexpr, eps, n_parts,
                   PARTS: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    block = pid // SPLIT  # our BLOCK_N output columns
    part = pid % SPLIT  # our share of K
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    cols = tl.arange(0, BLOCK_N)
    rn = block * BLOCK_N + cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    K_PART: tl.constexpr = K // SPLIT
    for k in range(part * K_PART, (part + 1) * K_PART, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :])
        acc += tl.dot(x, tl.trans(w))
        if SWIGLU:
            w_up = tl.load(w_ptr + (rn + N)[:, None].to(tl.int64) * K + rk[None, :])
            acc_up += tl.dot(x, tl.trans(w_up))
    if SPLIT == 1:
        _epilogue(acc, acc_up, b_ptr, y_ptr, r_ptr, parts_in_ptr, parts_out_ptr, block, rm, row_ok, rn, N, K, eps,
                  n_parts, PARTS, RESIDUAL, SWIGLU, HAS_BIAS, BLOCK_M)
    else:
        # Split K: each program leaves its partial tile in the workspace; the last of a column
        # block to arrive (counted atomically) sums them in a fixed order and finishes.
        tile = (rm[:, None] * BLOCK_N + cols[None, :])
        tl.store(ws_ptr + pid * BLOCK_M * BLOCK_N + tile, acc)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(ws_ptr + (block * SPLIT + s) * BLOCK_M * BLOCK_N + tile, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + block, 0)  # zero again for the next launch (or graph replay)
            _epilogue(total, acc_up, b_ptr, y_ptr, r_ptr, parts_in_ptr, parts_out_ptr, block, rm, row_ok, rn, N, K,
                      eps, n_parts, PARTS, RESIDUAL, SWIGLU, HAS_BIAS, BLOCK_M)


@triton.jit
def _epilogue(acc, acc_up, b_ptr, y_ptr, r_ptr, parts_in_ptr, parts_out_ptr, block, rm, row_ok, rn, N, K, eps,
              n_parts, PARTS: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
              BLOCK_M: tl.constexpr):
    if PARTS > 0:
        # The producer's partial sums of squares, [n_parts, BLOCK_M] (PARTS: n_parts rounded up to a power of 2).
        p = tl.arange(0, PARTS)
        squares = tl.load(parts_in_ptr + p[:, None] * BLOCK_M + rm[None, :], mask=p[:, None] < n_parts, other=0.0)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    dt = y_ptr.dtype.element_ty
    if SWIGLU:
        # Round where the reference rounds: each projection, silu's result, then the product.
        gate = acc.to(dt).to(tl.float32)
        acc = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)
    out = y_ptr + rm[:, None] * N + rn[None, :]
    if RESIDUAL:
        r = tl.load(r_ptr + rm[:, None] * N + rn[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        summed = (acc.to(dt).to(tl.float32) + r).to(dt)
        tl.store(out, summed, mask=row_ok[:, None])
        s = summed.to(tl.float32)
        tl.store(parts_out_ptr + block * BLOCK_M + rm, tl.sum(s * s, axis=1))
    else:
        tl.store(out, acc.to(dt), mask=row_ok[:, None])


# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT) by (kind, K, N, BLOCK_M); see worker/kernels/tune_skinny.py.
CONFIGS: dict[tuple[str, int, int, int], tuple[int, int, int, int, int]] = {}
DEFAULT_CONFIG = (16, 256, 4, 4, 1)
# (hidden, BLOCK_M) -> whether the five-kernel layer beat the eight separate kernels when measured;
# a shape never measured takes it.
LAYER_WINS: dict[tuple[int, int], bool] = {}


def load_configs(path: str) -> None:
    """Take the table a run of worker/kernels/tune_skinny.py wrote (EngineOptions.skinny_configs)."""
    import json

    with open(path) as f:
        load_configs_dict(json.load(f)["configs"])


def load_configs_dict(configs: dict) -> None:
    for key, config in configs.items():
        kind, k, n, m = key.split(",")
        if kind == "layer":  # k is the hidden size; config [1] or [0]: whether the five-kernel layer won
            LAYER_WINS[(int(k), int(m))] = bool(config[0])
        else:
            CONFIGS[(kind, int(k), int(n), int(m))] = tuple(config)


def layer_wins(hidden: int, tokens: int) -> bool:
    return LAYER_WINS.get((hidden, max(16, triton.next_power_of_2(tokens))), True)


load_configs_dict(MEASURED)


def config_for(kind: str, k: int, n: int, block_m: int) -> tuple[int, int, int, int, int]:
    block_n, block_k, warps, stages, split = CONFIGS.get((kind, k, n, block_m), DEFAULT_CONFIG)
    if kind not in ("residual", "plain"):
        split = 1  # SWIGLU's up half and the norm's scale are not kept per split
    while k % (split * 64):
        split //= 2
    while (k // split) % block_k:  # a K step that divides each split (fits() asks for K % 64 == 0)
        block_k //= 2
    while n % block_n:
        block_n //= 2
    return block_n, block_k, warps, stages, split


def kind_of(parts, residual, swiglu) -> str:
    return "swiglu" if swiglu else "norm" if parts is not None else "residual" if residual is not None else "plain"


def fits(tokens: int, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """Whether a [tokens, K] @ weight.T product takes these kernels."""
    n, k = weight.shape
    n = n // 2 if swiglu else n
    return tokens <= MAX_ROWS and n % 16 == 0 and k % 64 == 0 and weight.dtype in (torch.bfloat16, torch.float16)


_COUNTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counts(device: torch.device, blocks: int) -> torch.Tensor:
    """The split-K arrival counters: zeros, one per column block, shared by every launch on the
    current stream. Each launch leaves them zero again, and launches on one stream run one after
    another, so no launch ever needs a memset of its own. Each stream has its own: the worker's
    two lanes run at once, and a bulk batch of a few tokens takes these kernels too. Bound: one
    tensor of at least 4,096 int32 per stream that runs these kernels (two in a worker)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    counts = _COUNTS.get(key)
    if counts is None or counts.numel() < blocks:
        counts = _COUNTS[key] = torch.zeros(max(blocks, 4096), device=device, dtype=torch.int32)
    return counts


class Parts:
    """Per-row partial sums of squares a RESIDUAL product leaves for the next norm: [programs, BLOCK_M]."""

    __slots__ = ("data", "count")

    def __init__(self, data: torch.Tensor, count: int):
        self.data, self.count = data, count


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  residual: torch.Tensor | None = None, parts: Parts | None = None, eps: float = 0.0,
                  swiglu: bool = False, config: tuple[int, int, int, int, int] | None = None):
    """y = f(x @ weight.T (+ bias)) for up to MAX_ROWS rows of x.

    parts (from the RESIDUAL product that wrote x): x is a raw residual, and the product is of
      rms_norm(x) (the norm weight must be folded into `weight`); eps is the norm's.
    swiglu: weight is [gate; up] (2I rows) and y = silu(x @ gate.T) * (x @ up.T), [rows, I].
    residual: returns (residual + y, Parts) instead of y: the new residual and its sums of squares.
    """
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    block_n, block_k, warps, stages, split = config or config_for(kind_of(parts, residual, swiglu), k, n, block_m)
    y = x.new_empty(m, n)
    programs = n // block_n
    parts_out = torch.empty(programs, block_m, device=x.device, dtype=torch.float32) if residual is not None else y
    ws = torch.empty(programs * split * block_m * block_n, device=x.device, dtype=torch.float32) if split > 1 else y
    if parts is not None and parts.data.shape[1] != block_m:
        raise ValueError("parts come from a product over a different number of rows")
    _skinny_linear[(programs * split,)](
        x, weight, bias if bias is not None else x, y, residual if residual is not None else x,
        parts.data if parts is not None else x, parts_out, ws, arrival_counts(x.device, programs) if split > 1 else y,
        m, n, k, eps, parts.count if parts is not None else 0,
        PARTS=triton.next_power_of_2(parts.count) if parts is not None else 0, RESIDUAL=residual is not None,
        SWIGLU=swiglu, HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    if residual is not None:
        return y, Parts(parts_out, programs)
    return y
