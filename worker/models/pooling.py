"""Pooling of packed hidden states into one vector per sequence, shared by all model families."""

from __future__ import annotations

import torch

from worker.models.packing import segment_ids

POOLING_MODES = ("mean", "cls", "last")


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [T, H] (any float dtype) -> float32 [B, H]; mode is "mean", "cls" or "last"."""
    cu = cu_seqlens.long()
    if mode == "cls":
        return hidden[cu[:-1]].float()
    if mode == "last":
        return hidden[cu[1:] - 1].float()
    if mode == "mean":
        batch = cu.shape[0] - 1
        # Sum in float32 even for bf16 models: a 32K-token mean in bf16 loses most of its bits.
        sums = torch.zeros(batch, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segment_ids(cu, hidden.shape[0]), hidden.float())
        # clamp: an empty (padding) sequence yields zeros instead of NaN.
        lengths = (cu[1:] - cu[:-1]).clamp(min=1).unsqueeze(1)
        return sums / lengths
    raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
