"""Attention over packed sequences: q [T, heads, D], k and v [T, kv_heads, D], bounded by cu_seqlens.

Grouped-query attention (kv_heads dividing heads) is handled by every path. On CUDA the packed
tokens go through one varlen flash-attention kernel: flash_attn's `flash_attn_varlen_func` when
that package is importable (an optional extra), else torch's own `varlen_attn` (torch >= 2.10).
Both take int32 cu_seqlens and fp16/bf16 tensors, never sync with the host, and capture into
CUDA graphs. On the CPU, one SDPA call per sequence: simple and exact.
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.nn.functional as F

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


def _short_kernels(q: torch.Tensor, max_seqlen: int) -> bool:
    from pollen.worker import kernels
    from pollen.worker.models import ops

    return ops.use_triton(q) and kernels.short_attention_fits(max_seqlen, q.shape[2])


def backend(device_is_cuda: bool, dtype: torch.dtype = torch.bfloat16) -> str:
    """Which kernel attention uses: "flash_attn", "torch_varlen" or "sdpa_loop".

    The flash kernels take fp16/bf16 only; float32 on CUDA (a debugging mode) takes the loop.
    """
    if device_is_cuda and dtype in (torch.float16, torch.bfloat16):
        if _flash_varlen is not None and os.environ.get("POLLEN_FLASH_ATTN", "1") != "0":
            return "flash_attn"
        if _torch_varlen is not None:
            return "torch_varlen"
    return "sdpa_loop"


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
) -> torch.Tensor:
    """Each sequence attends only to itself; returns [T, heads, D]."""
    kind = backend(q.is_cuda, q.dtype)
    gqa = k.shape[1] != q.shape[1]
    if kind != "sdpa_loop" and _short_kernels(q, max_seqlen):
        # Queries: a register-resident Triton kernel beats a flash launch sized for long inputs.
        from pollen.worker.kernels.short_attention import short_attention

        return short_attention(q, k, v, cu_seqlens, max_seqlen, causal)
    if kind == "flash_attn":
        return _flash_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal)
    if kind == "torch_varlen":
        return _torch_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                             **_torch_varlen_options(causal, gqa))

    out = torch.empty_like(q)
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
