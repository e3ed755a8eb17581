"""Fused Triton kernels for the CUDA engine, used when Triton is importable.

`available()` says whether they can run; worker/models/ops.py holds the plain-torch references
they must equal, and tests/test_cuda_engine.py checks that on a GPU. Importing this package never
fails: without Triton, `available()` is False and the references run instead.
"""
from __future__ import annotations

import functools


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def add_rms_norm(x, residual, weight, eps):
    from pollen.worker.kernels.norms import add_rms_norm as impl

    return impl(x, residual, weight, eps)


def embed_rms_norm(ids, table, weight, eps):
    from pollen.worker.kernels.norms import embed_rms_norm as impl

    return impl(ids, table, weight, eps)


def qk_norm_rope(qkv, q_weight, k_weight, cache, positions, heads, kv_heads, eps):
    from pollen.worker.kernels.rope import qk_norm_rope as impl

    return impl(qkv, q_weight, k_weight, cache, positions, heads, kv_heads, eps)


SHORT_MAX_LEN = 64  # sequences the short-attention kernels hold in registers


def short_attention_fits(max_seqlen: int, head_dim: int, rope: bool = False) -> bool:
    """Whether the short-attention kernels take this batch. Their matrix products need 16 or more
    along the reduced axis: head_dim itself, or head_dim / 2 when RoPE works on halves."""
    import os

    dims = (32, 64, 128, 256) if rope else (16, 32, 64, 128, 256)
    return (max_seqlen <= SHORT_MAX_LEN and head_dim in dims
            and os.environ.get("POLLEN_SHORT_ATTENTION", "1") != "0")


def short_qk_rope_attention(qkv, q_weight, k_weight, cache, positions, heads, kv_heads, eps, cu_seqlens,
                            max_seqlen, causal):
    from pollen.worker.kernels.short_attention import short_qk_rope_attention as impl

    return impl(qkv, q_weight, k_weight, cache, positions, heads, kv_heads, eps, cu_seqlens, max_seqlen, causal)


def skinny_fits(tokens, weight, swiglu=False):
    """Whether a product of `tokens` rows takes worker/kernels/skinny.py (POLLEN_SKINNY=0: never)."""
    import os

    from pollen.worker.kernels.skinny import fits

    return os.environ.get("POLLEN_SKINNY", "1") != "0" and fits(tokens, weight, swiglu)


def skinny_layer_wins(hidden, tokens):
    from pollen.worker.kernels.skinny import layer_wins

    return layer_wins(hidden, tokens)


def skinny_linear(x, weight, bias=None, **options):
    from pollen.worker.kernels.skinny import skinny_linear as impl

    return impl(x, weight, bias, **options)


def silu_mul(gate_up):
    from pollen.worker.kernels.activations import silu_mul as impl

    return impl(gate_up)
