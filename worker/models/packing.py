"""Index helpers for packed batches: T tokens of B sequences, bounded by cu_seqlens [B+1].

All of these stay on the device and never read cu_seqlens back to the host, so they can run
inside a CUDA graph (repeat_interleave gets output_size for exactly that reason).
"""

from __future__ import annotations

import torch


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] int64: which sequence each token belongs to."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    seqs = torch.arange(lengths.shape[0], device=cu.device)
    return torch.repeat_interleave(seqs, lengths, output_size=total)


def positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] int64: position of each token inside its own sequence (restarts at 0 per sequence)."""
    cu = cu_seqlens.long()
    return torch.arange(total, device=cu.device) - cu[segment_ids(cu, total)]
