"""Attention over packed sequences: q [T, heads, D], k and v [T, kv_heads, D], bounded by cu_seqlens.

Grouped-query attention (kv_heads dividing heads) is handled by every path. On CUDA the packed
tokens go through one varlen flash-attention kernel: flash_attn's `flash_attn_varlen_func` when
that package is importable (an optional extra) and EngineOptions.flash_attn is on, else torch's
own `varlen_attn` (torch >= 2.10). Both take int32 cu_seqlens and fp16/bf16 tensors, never sync
with the host, and capture into CUDA graphs. On the CPU, one SDPA call per sequence: simple and
exact. `backend` picks the kernel once per model; `VarlenAttention` runs it, and a model's short
batches (every sequence at most kernels.SHORT_MAX_LEN tokens) take the Triton short-attention
kernel when the model's Ops has one.

A sliding window of half-width w: token i sees the keys j of its own sequence with |i - j| <= w,
and j <= i when causal. ModernBERT's local layers are bidirectional (transformers' bidirectional
sliding-window mask), Mistral's window causal (w = sliding_window - 1). The flash kernels take it
as window_size=(w, w), or (w, 0) when causal; the SDPA loop
gives each sequence longer than w + 1 a band mask. A sequence of at most w + 1 tokens sees all of
itself anyway, so the short-attention kernel (which has no window) takes a windowed batch only
when max_seqlen <= w + 1.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pollen.common.engine_options import EngineOptions
from pollen.common.model_spec import UnsupportedModel
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

    `kind` is backend()'s choice; `window`, when set, the sliding window's half-width (the module
    docstring); `short`, when set, takes the batches whose sequences are all at most `short_max`
    tokens long (for queries a register-resident Triton kernel beats a flash launch sized for
    long inputs): kernels.SHORT_MAX_LEN, or less where a window would cut a longer sequence.
    """

    __slots__ = ("kind", "short", "short_max", "window", "_run")

    def __init__(self, kind: str, short: Callable | None = None, window: int | None = None):
        if window is not None and window < 0:
            raise ValueError(f"window {window} must be a half-width of 0 or more")
        if window is not None and kind == "torch_varlen" and "window_size" not in _VARLEN_PARAMS:
            raise UnsupportedModel("sliding-window attention needs torch's varlen_attn with window_size (a newer "
                                   "torch) or flash-attn (the `flash` extra); this torch has neither")
        self.kind, self.short, self.window = kind, short, window
        self.short_max = kernels.SHORT_MAX_LEN if window is None else min(kernels.SHORT_MAX_LEN, window + 1)
        self._run = {"flash_attn": _flash_attention, "torch_varlen": _torch_varlen_attention,
                     "sdpa_loop": _sdpa_loop}[kind]

    @classmethod
    def of(cls, ops: Ops, head_dim: int, window: int | None = None) -> VarlenAttention:
        """A model's attention: ops' varlen kernel, and its short-attention kernel where it has one,
        the heads' size suits it, and the varlen kernel is a flash kernel (not the SDPA loop)."""
        takes = ops.attention != "sdpa_loop" and kernels.short_attention_takes(head_dim)
        return cls(ops.attention, ops.short_attention if takes else None, window)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_seqlen: int, causal: bool) -> torch.Tensor:
        if self.short is not None and max_seqlen <= self.short_max:
            return self.short(q, k, v, cu_seqlens, max_seqlen, causal)
        # max_seqlen is a host int: a window no sequence reaches is dropped without a sync.
        window = self.window if self.window is not None and max_seqlen > self.window + 1 else None
        return self._run(q, k, v, cu_seqlens, max_seqlen, causal, window)


def _window_size(causal: bool, window: int | None) -> tuple[int, int]:
    """flash's (left, right) reach; -1 is unbounded."""
    reach = -1 if window is None else window
    return reach, 0 if causal else reach


def _flash_attention(q, k, v, cu_seqlens, max_seqlen, causal, window):
    extra = {} if window is None else {"window_size": _window_size(causal, window)}
    return _flash_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal, **extra)


def _torch_varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal, window):
    return _torch_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                         **_torch_varlen_options(causal, k.shape[1] != q.shape[1], window))


def _sdpa_loop(q, k, v, cu_seqlens, max_seqlen, causal, window=None):
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    bounds = cu_seqlens.tolist()  # the host sync costs nothing on the CPU
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # SDPA wants [batch, heads, L, D]: with the batch dimension torch takes its fused CPU
        # flash kernel (no mask), which it never does for [heads, L, D]; that falls back to the
        # op-by-op math path, slower the longer the sequence.
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if window is not None and end - start > window + 1:
            mask = band_mask(end - start, window, causal, q.device)
            attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)
        else:
            attended = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
        out[start:end] = attended[0].transpose(0, 1)
    return out


def band_mask(length: int, window: int, causal: bool, device) -> torch.Tensor:
    """[length, length] bool, True where query i may see key j: |i - j| <= window (and j <= i when causal)."""
    i = torch.arange(length, device=device)
    offset = i[None, :] - i[:, None]  # key minus query
    allowed = offset.abs() <= window
    return allowed & (offset <= 0) if causal else allowed


def _torch_varlen_options(causal: bool, gqa: bool, window: int | None = None) -> dict:
    options = {}
    if "window_size" in _VARLEN_PARAMS:
        options["window_size"] = _window_size(causal, window)
    else:  # VarlenAttention refuses a window on such a torch
        options["is_causal"] = causal
    if gqa and "enable_gqa" in _VARLEN_PARAMS:
        options["enable_gqa"] = True
    # Without enable_gqa, the flash kernel underneath still takes fewer kv heads (it always has).
    return options
