"""Fused Triton kernels for the CUDA engine.

A model takes them, chosen once when it is loaded (worker/models/loader.py, `choose_ops`), on
CUDA when Triton is importable (`available()`) and EngineOptions.triton is on: `fused.triton_ops`
then imports the kernel modules and hands them over as the model's `Ops`. worker/models/ops.py
holds the plain-torch references they must equal; tests/test_cuda_engine.py checks that on a GPU.
This package itself never imports Triton, so a CPU host without it imports it freely.
"""
from __future__ import annotations

import functools

SHORT_MAX_LEN = 64  # sequences the short-attention kernels hold in registers


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def short_attention_takes(head_dim: int, rope: bool = False) -> bool:
    """Whether the short-attention kernels take heads of this size (batches must also have no
    sequence over SHORT_MAX_LEN tokens). Their matrix products need 16 or more along the reduced
    axis: head_dim itself, or head_dim / 2 when RoPE works on halves."""
    return head_dim in ((32, 64, 128, 256) if rope else (16, 32, 64, 128, 256))
