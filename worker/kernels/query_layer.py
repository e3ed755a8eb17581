"""A whole Qwen3 layer in one launch for query-sized batches (at most 32 tokens): the five kernels
of the query layer (worker/kernels/skinny.py: qkv, attention, o, gate/up, down) run as five phases
of one persistent kernel, one program per SM, with a grid-wide barrier between phases.

Why: at these sizes a product is bound by latency, not bandwidth (docs/gpu-notes.md, steps 4 and
8): each of the 140 kernels of a 28-layer query pays a launch, a ramp-up and a tail of about
2-3 µs, and HBM idles meanwhile. Here the phase boundary is a barrier (an atomic count in L2), and
at the start of each phase every program prefetches into L2 the weight slices it will read in the
next weighted phase (and, in the gate/up phase, the next layer's qkv slices), so HBM keeps
streaming through the boundaries and the products read their weights from L2.

Each phase is the same code as the separate kernels (`skinny.product_item`,
`short_attention.qk_rope_attend`), so the results are the same bits. Work items go round-robin
over the programs (item i to program i mod P).

A barrier needs every program of the launch resident at once. P is the SM count, and each program
needs far less than an SM, so one launch alone always fits; two persistent launches at once on one
GPU could each hold part of the SMs and wait for ever. Only the interactive lane (one stream) runs
it: worker/models/qwen3.py takes it only when the engine says so (`persistent` on the model).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pollen.worker.kernels.short_attention import qk_rope_attend
from pollen.worker.kernels.skinny import arrival_counts, config_for, product_item

MAX_ROWS = 32
LINE = 64  # bf16/fp16 elements in one 128-byte cache line
STAMPS: tl.constexpr = tl.constexpr(11)  # clock stamps a program leaves per launch with TIMELINE


@triton.jit
def _prefetch_l2(ptrs):
    # One L2 prefetch per pointer; is_pure=False keeps it although its value is unused.
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_items(pid, w_ptr, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                    SWIGLU: tl.constexpr, P: tl.constexpr, LINES: tl.constexpr):
    """Pull into L2 the weight slices this program reads in a coming product phase (the same
    round-robin items), one prefetch per 128-byte line (LINES: the lines of a slice's row, rounded
    up to a power of 2; the extra lanes repeat the last line)."""
    K_PART: tl.constexpr = K // SPLIT
    line = tl.minimum(tl.arange(0, LINES), K_PART // 64 - 1) * 64
    cols = tl.arange(0, BLOCK_N)
    for item in range(pid, (N // BLOCK_N) * SPLIT, P):
        rn = (item // SPLIT) * BLOCK_N + cols
        ptrs = w_ptr + rn[:, None].to(tl.int64) * K + ((item % SPLIT) * K_PART + line)[None, :]
        _prefetch_l2(ptrs)
        if SWIGLU:
            _prefetch_l2(ptrs + N * K)


@triton.jit
def _stamp(clock_ptr, i, TIMELINE: tl.constexpr):
    """TIMELINE: write the GPU's global nanosecond clock as this program's i-th stamp (the phase
    profile of load/bench_query_layer.py); otherwise nothing."""
    if TIMELINE:
        pid = tl.program_id(0)
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                        pack=1)
        tl.store(clock_ptr + pid * STAMPS + i, now)


@triton.jit
def _grid_sync(bar_ptr, target):
    """Wait until the launch's programs have all arrived (the count reaches target = P times the
    barrier's number). Release: this program's writes before it; acquire: everyone's after it."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    while tl.load(bar_ptr, volatile=True) < target:
        pass
    tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _leave(bar_ptr, P: tl.constexpr):
    """The last program out zeroes the barrier counts for the next launch (or graph replay): by
    then every program has passed every barrier."""
    tl.debug_barrier()
    out = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if out == P - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_xchg(bar_ptr + 1, 0)


@triton.jit
def _query_layer(in_ptr, r_ptr, parts_ptr, qkv_ptr, attn_ptr, act_ptr, ws_ptr, count_ptr, bar_ptr,
                 w_qkv, w_o, w_gu, w_down, w_next, cu_ptr, pos_ptr, qn_ptr, kn_ptr, cache_ptr, n_seqs, M, eps, scale,
                 HIDDEN: tl.constexpr, HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
                 ATT_BLOCK: tl.constexpr, CAUSAL: tl.constexpr, NEXT: tl.constexpr,
                 BLOCK_M: tl.constexpr, QKV_BN: tl.constexpr, QKV_BK: tl.constexpr, RES_BN: tl.constexpr,
                 O_BK: tl.constexpr, O_SPLIT: tl.constexpr, GU_BN: tl.constexpr, GU_BK: tl.constexpr,
                 DOWN_BK: tl.constexpr, DOWN_SPLIT: tl.constexpr, PARTS: tl.constexpr, QKV_PARTS: tl.constexpr,
                 QKV_LINES: tl.constexpr, O_LINES: tl.constexpr, GU_LINES: tl.constexpr, DOWN_LINES: tl.constexpr,
                 PREFETCH: tl.constexpr, TIMELINE: tl.constexpr, clock_ptr, P: tl.constexpr):
    """in_ptr: the first layer's normalized input (QKV_PARTS 0), or the residual (QKV_PARTS: PARTS,
    the number of its sums of squares rounded up to a power of 2)."""
    pid = tl.program_id(0)
    x_ptr = r_ptr  # the unused pointer arguments of product_item
    QKV_N: tl.constexpr = (HEADS + 2 * KV) * D
    N_PARTS: tl.constexpr = HIDDEN // RES_BN
    # qkv = rms_norm(r) @ W_qkv.T (the first layer reads x, the embedding already normalized)
    _stamp(clock_ptr, 0, TIMELINE)
    if PREFETCH:
        _prefetch_items(pid, w_o, HIDDEN, HEADS * D, O_SPLIT, RES_BN, False, P, O_LINES)
    for item in range(pid, QKV_N // QKV_BN, P):
        product_item(item, in_ptr, w_qkv, x_ptr, qkv_ptr, x_ptr, parts_ptr, x_ptr, x_ptr, x_ptr,
                     M, QKV_N, HIDDEN, eps, N_PARTS, QKV_PARTS, False, False, False, 1, BLOCK_M, QKV_BN, QKV_BK)
    _stamp(clock_ptr, 1, TIMELINE)
    _grid_sync(bar_ptr, P)
    _stamp(clock_ptr, 2, TIMELINE)
    # attention, one (sequence, head) an item
    if PREFETCH:
        _prefetch_items(pid, w_gu, INTER, HIDDEN, 1, GU_BN, True, P, GU_LINES)
    for item in range(pid, n_seqs * HEADS, P):
        qk_rope_attend(item // HEADS, item % HEADS, qkv_ptr, attn_ptr, cu_ptr, pos_ptr, qn_ptr, kn_ptr, cache_ptr,
                       eps, scale, HEADS, KV, D, ATT_BLOCK, CAUSAL)
    _stamp(clock_ptr, 3, TIMELINE)
    _grid_sync(bar_ptr, 2 * P)
    _stamp(clock_ptr, 4, TIMELINE)
    # r += attn @ W_o.T, and r's per-tile sums of squares
    if PREFETCH:
        _prefetch_items(pid, w_down, HIDDEN, INTER, DOWN_SPLIT, RES_BN, False, P, DOWN_LINES)
    for item in range(pid, N_PARTS * O_SPLIT, P):
        product_item(item, attn_ptr, w_o, x_ptr, r_ptr, r_ptr, x_ptr, parts_ptr, ws_ptr, count_ptr,
                     M, HIDDEN, HEADS * D, eps, 0, 0, True, False, False, O_SPLIT, BLOCK_M, RES_BN, O_BK)
    _stamp(clock_ptr, 5, TIMELINE)
    _grid_sync(bar_ptr, 3 * P)
    _stamp(clock_ptr, 6, TIMELINE)
    # act = silu(rms_norm(r) @ W_gate.T) * (rms_norm(r) @ W_up.T)
    if NEXT and PREFETCH:
        _prefetch_items(pid, w_next, QKV_N, HIDDEN, 1, QKV_BN, False, P, QKV_LINES)
    for item in range(pid, INTER // GU_BN, P):
        product_item(item, r_ptr, w_gu, x_ptr, act_ptr, x_ptr, parts_ptr, x_ptr, x_ptr, x_ptr,
                     M, INTER, HIDDEN, eps, N_PARTS, PARTS, False, True, False, 1, BLOCK_M, GU_BN, GU_BK)
    _stamp(clock_ptr, 7, TIMELINE)
    _grid_sync(bar_ptr, 4 * P)
    _stamp(clock_ptr, 8, TIMELINE)
    # r += act @ W_down.T, and r's sums of squares for the next layer's norm
    for item in range(pid, N_PARTS * DOWN_SPLIT, P):
        product_item(item, act_ptr, w_down, x_ptr, r_ptr, r_ptr, x_ptr, parts_ptr, ws_ptr, count_ptr,
                     M, HIDDEN, INTER, eps, 0, 0, True, False, False, DOWN_SPLIT, BLOCK_M, RES_BN, DOWN_BK)
    _stamp(clock_ptr, 9, TIMELINE)
    _leave(bar_ptr, P)
    _stamp(clock_ptr, 10, TIMELINE)


_BARRIERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def barrier_counts(device: torch.device) -> torch.Tensor:
    """The barrier's two counts (arrivals, exits) for launches on the current stream: zero between
    launches, as each launch's last program leaves them."""
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    if key not in _BARRIERS:
        _BARRIERS[key] = torch.zeros(2, device=device, dtype=torch.int32)
    return _BARRIERS[key]


def fits(tokens: int, qkv: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
         has_bias: bool) -> bool:
    """Whether a layer of these weights over `tokens` rows takes the persistent kernel."""
    hidden = o.shape[0]
    return (tokens <= MAX_ROWS and not has_bias and qkv.dtype in (torch.bfloat16, torch.float16)
            and all(w.shape[1] % 64 == 0 and w.is_contiguous() for w in (qkv, o, gate_up, down))
            and hidden % 32 == 0 and torch.cuda.get_device_capability(qkv.device)[0] >= 8)


class Scratch:
    """One forward's buffers, shared by its layers: the products' outputs, the split-K workspace,
    the residual's per-tile sums of squares."""

    def __init__(self, tokens: int, hidden: int, qkv_n: int, attn_n: int, inter: int, like: torch.Tensor,
                 configs: dict | None = None, ctas_per_sm: int = 1):
        """configs, ctas_per_sm: for load/bench_query_layer.py, other tilings (the products' config
        tuples by "qkv", "o", "gu", "down") and several programs per SM (checked to fit at launch)."""
        self.block_m = max(16, triton.next_power_of_2(tokens))
        self.qkv = like.new_empty(tokens, qkv_n)
        self.attn = like.new_empty(tokens, attn_n)
        self.act = like.new_empty(tokens, inter)
        self.configs = {
            "qkv": config_for("norm", hidden, qkv_n, self.block_m),
            "o": config_for("residual", attn_n, hidden, self.block_m),
            "gu": config_for("swiglu", hidden, inter, self.block_m),
            "down": config_for("residual", inter, hidden, self.block_m)}
        self.configs.update(configs or {})
        res_bn = self.configs["o"][0]
        if self.configs["down"][0] != res_bn:  # both write the sums of squares: one tiling of the residual
            self.configs["down"] = (res_bn,) + self.configs["down"][1:]
        items = (hidden // res_bn) * max(self.configs["o"][4], self.configs["down"][4])
        self.ws = torch.empty(items * self.block_m * res_bn, device=like.device, dtype=torch.float32)
        self.parts = torch.empty(hidden // res_bn, self.block_m, device=like.device, dtype=torch.float32)
        self.sms = torch.cuda.get_device_properties(like.device).multi_processor_count
        self.programs = self.sms * ctas_per_sm
        self.checked = ctas_per_sm == 1  # one program an SM always fits


def query_layer(x: torch.Tensor | None, residual: torch.Tensor, scratch: Scratch, qkv: torch.Tensor,
                o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, next_qkv: torch.Tensor | None,
                q_weight: torch.Tensor, k_weight: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int, heads: int, kv_heads: int, eps: float,
                causal: bool, *, prefetch: bool = True, timeline: torch.Tensor | None = None,
                warps: int | None = None) -> None:
    """One Qwen3 layer on `residual` [T, hidden], in place (its norms folded into qkv and gate_up).
    x: the first layer's normalized input (the embedding's norm); None: the norm of `residual`,
    from the sums of squares the previous layer left in scratch. next_qkv: the next layer's qkv
    weight, prefetched during this one. For load/bench_query_layer.py: prefetch off; timeline, an
    int64 [programs, STAMPS] tensor the launch fills with each program's clock at its phase
    boundaries; warps instead of the qkv product's configured count."""
    tokens, hidden = residual.shape
    d = q_weight.shape[0]
    inter = down.shape[1]
    qkv_bn, qkv_bk, configured_warps, stages, _ = scratch.configs["qkv"]
    res_bn, o_bk, _, _, o_split = scratch.configs["o"]
    gu_bn, gu_bk, _, _, _ = scratch.configs["gu"]
    _, down_bk, _, _, down_split = scratch.configs["down"]
    device = residual.device
    count = arrival_counts(device, hidden // res_bn)
    parts = triton.next_power_of_2(hidden // res_bn)

    def lines(k: int, split: int = 1) -> int:
        return triton.next_power_of_2(k // split // LINE)

    args = (
        x if x is not None else residual, residual, scratch.parts, scratch.qkv, scratch.attn, scratch.act, scratch.ws,
        count, barrier_counts(device), qkv, o, gate_up, down, next_qkv if next_qkv is not None else qkv,
        cu_seqlens, positions, q_weight, k_weight, cache, cu_seqlens.shape[0] - 1, tokens, eps, d ** -0.5)
    constants = dict(
        HIDDEN=hidden, HEADS=heads, KV=kv_heads, D=d, INTER=inter,
        ATT_BLOCK=max(16, triton.next_power_of_2(max_seqlen)), CAUSAL=causal, NEXT=next_qkv is not None,
        BLOCK_M=scratch.block_m,
        QKV_BN=qkv_bn, QKV_BK=qkv_bk, RES_BN=res_bn, O_BK=o_bk, O_SPLIT=o_split, GU_BN=gu_bn, GU_BK=gu_bk,
        DOWN_BK=down_bk, DOWN_SPLIT=down_split, PARTS=parts, QKV_PARTS=0 if x is not None else parts,
        QKV_LINES=lines(hidden), O_LINES=lines(heads * d, o_split), GU_LINES=lines(hidden),
        DOWN_LINES=lines(inter, down_split), PREFETCH=prefetch, TIMELINE=timeline is not None,
        clock_ptr=timeline if timeline is not None else scratch.parts)
    options = dict(constants, num_warps=warps or configured_warps, num_stages=stages)
    if not scratch.checked:  # several programs an SM: only if they all fit at once, or the barrier never opens
        compiled = _query_layer.warmup(*args, P=scratch.programs, grid=(scratch.programs,), **options)
        regs = compiled.n_regs * 32 * (warps or configured_warps)
        fit = min(65536 // max(regs, 1), (227 * 1024) // max(compiled.metadata.shared, 1))
        if fit * scratch.sms < scratch.programs:
            print(f"query_layer: {fit} programs an SM fit ({compiled.n_regs} registers a thread, "
                  f"{compiled.metadata.shared} bytes of shared memory); one an SM instead", flush=True)
            scratch.programs = scratch.sms
        scratch.checked = True
    _query_layer[(scratch.programs,)](*args, P=scratch.programs, **options)
