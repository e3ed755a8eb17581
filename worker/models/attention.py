"""Attention over packed sequences: q, k, v are [T, heads, head_dim], bounded by cu_seqlens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # torch >= 2.10 ships a flash-attention varlen kernel (CUDA only).
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
) -> torch.Tensor:
    """Each sequence attends only to itself; returns [T, heads, head_dim]."""
    if q.is_cuda and _varlen_attn is not None:
        # CUDA seam (the GPU issue owns it): one kernel over all packed tokens, no host sync,
        # capturable in a CUDA graph. Needs int32 cu_seqlens and fp16/bf16 q, k, v.
        window = (-1, 0) if causal else (-1, -1)
        return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=window)

    # CPU (and fallback): one SDPA call per sequence. Simple and exact; the host sync from
    # tolist() costs nothing on CPU.
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # SDPA wants [heads, L, head_dim].
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1)
    return out
