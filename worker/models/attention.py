"""Attention over packed sequences: q [T, heads, D], k and v [T, kv_heads, D], bounded by cu_seqlens.

Grouped-query attention (kv_heads dividing heads) is handled by every path. On CUDA the packed
tokens go through one varlen flash-attention kernel: flash_attn's `flash_attn_varlen_func` when
that package is importable (an optional extra) and EngineOptions.flash_attn is on, else torch's
own `varlen_attn` (torch >= 2.10). Both take int32 cu_seqlens and fp16/bf16 tensors, never sync
with the host, and capture into CUDA graphs. On the CPU, one SDPA call per sequence: simple and
exact. `backend` picks the kernel once per model; `VarlenAttention` runs it, and a model's short
batches (every sequence at most kernels.SHORT_MAX_LEN tokens) take the Triton short-attention
kernel when the model's Ops has one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pollen.common.engine_options import EngineOptions
from pollen.worker import kernels
from pollen.worker.models.ops import Ops

try:
    from torch.nn.attention.varlen import varlen_attn as _torch_varlen

    # The signature moved between torch releases: window_size replaced is_causal, and enable_gqa
    # arrived later. Look once, call whichever this torch has.
    _VARLEN_PARAMS = set(inspect.signature(_torch_varlen).parameters)
except ImportError:  # pragma: no cover - older torch
    _torch_varlen, _VARLEN_PARAMS = None, set()

try:  # pragma: no cover - optional extra, absent in CI
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except ImportError:
    _flash_varlen = None


def backend(device: torch.device, dtype: torch.dtype, options: EngineOptions) -> str:
    """Which kernel attention uses on this device and dtype: "flash_attn", "torch_varlen" or "sdpa_loop".

    The flash kernels take fp16/bf16 only; float32 on CUDA (a debugging mode) takes the loop.
    """
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if _flash_varlen is not None and options.flash_attn:
            return "flash_attn"
        if _torch_varlen is not None:
            return "torch_varlen"
    return "sdpa_loop"


class VarlenAttention:
    """Each sequence attends only to itself: (q, k, v, cu_seqlens, max_seqlen, causal) -> [T, heads, D].

    `kind` is backend()'s choice; `short`, when set, takes the batches whose sequences are all at
    most kernels.SHORT_MAX_LEN tokens long (for queries a register-resident Triton kernel beats a
    flash launch sized for long inputs).
    """

    __slots__ = ("kind", "short", "_run")

    def __init__(self, kind: str, short: Callable | None = None):
        self.kind, self.short = kind, short
        self._run = {"flash_attn": _flash_attention, "torch_varlen": _torch_varlen_attention,
                     "sdpa_loop": _sdpa_loop}[kind]

    @classmethod
    def of(cls, ops: Ops, head_dim: int) -> VarlenAttention:
        """A model's attention: ops' varlen kernel, and its short-attention kernel where it has one,
        the heads' size suits it, and the varlen kernel is a flash kernel (not the SDPA loop)."""
        takes = ops.attention != "sdpa_loop" and kernels.short_attention_takes(head_dim)
        return cls(ops.attention, ops.short_attention if takes else None)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_seqlen: int, causal: bool) -> torch.Tensor:
        if self.short is not None and max_seqlen <= kernels.SHORT_MAX_LEN:
            return self.short(q, k, v, cu_seqlens, max_seqlen, causal)
        return self._run(q, k, v, cu_seqlens, max_seqlen, causal)


def _flash_attention(q, k, v, cu_seqlens, max_seqlen, causal):
    return _flash_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal)


def _torch_varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal):
    return _torch_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                         **_torch_varlen_options(causal, k.shape[1] != q.shape[1]))


def _sdpa_loop(q, k, v, cu_seqlens, max_seqlen, causal):
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    bounds = cu_seqlens.tolist()  # the host sync costs nothing on the CPU
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # SDPA wants [heads, L, D].
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa).transpose(0, 1)
    return out


def _torch_varlen_options(causal: bool, gqa: bool) -> dict:
    options = {}
    if "window_size" in _VARLEN_PARAMS:
        options["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        options["is_causal"] = causal
    if gqa and "enable_gqa" in _VARLEN_PARAMS:
        options["enable_gqa"] = True
    # Without enable_gqa, the flash kernel underneath still takes fewer kv heads (it always has).
    return options
