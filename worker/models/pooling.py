"""Pooling of packed hidden states into output rows, shared by all model families and engines.

Two forms: `pool` over whole sequences (cu_seqlens), and `pool_rows` over arbitrary token spans
described by worker/packed.py's index arrays. `pool_rows` and `normalize_rows` have static shapes
and no host sync, so they run inside a CUDA graph with the rest of the forward.
"""

from __future__ import annotations

import torch

from pollen.worker.models.packing import segment_ids

POOLING_MODES = ("mean", "cls", "last", "max")


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [T, H] (any float dtype) -> float32 [B, H]; mode is "mean", "cls" or "last"."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    index = segment_ids(cu, hidden.shape[0])
    return pool_rows(hidden, index, cu[:-1], cu[1:] - 1, lengths, mode)


def pool_rows(hidden: torch.Tensor, pool_index: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
              count: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [T, H] -> float32 [R, H]; pool_index [T] names each token's row (R: none)."""
    # index_select takes the int32 indices as they are (no conversion kernel in the graph).
    if mode == "cls":
        return hidden.index_select(0, first).float()
    if mode == "last":
        return hidden.index_select(0, last).float()
    if mode == "mean":
        rows = first.shape[0]
        # Sum in float32 even for bf16 models: a 32K-token mean in bf16 loses most of its bits.
        # One extra row takes the tokens that belong to no row (padding, unpooled prefixes).
        sums = torch.zeros(rows + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, pool_index.long(), hidden.float())
        # clamp: an empty (padding) row yields zeros instead of NaN.
        return sums[:rows] / count.clamp(min=1).unsqueeze(1).to(torch.float32)
    if mode == "max":
        return max_rows(hidden, pool_index, first, last)
    raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")


def max_rows(hidden: torch.Tensor, pool_index: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """SPLADE's pooling: each row's largest value in every column, float32 [R, H]. The weights are
    >= 0, so zeros are the floor and an empty row is zeros.

    On a GPU, one scatter over the tokens, its index each token's row broadcast over the columns
    (a view: no [tokens, vocab] index is made), with static shapes and no host sync, so it runs
    inside a CUDA graph; the tokens of no row go to an extra row that is dropped. On the CPU each
    row's span is reduced on its own, which beats the scatter there."""
    rows = first.shape[0]
    if hidden.is_cuda:
        out = torch.zeros(rows + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        index = pool_index.long().unsqueeze(1).expand(-1, hidden.shape[1])
        out.scatter_reduce_(0, index, hidden.float(), "amax")
        return out[:rows]
    out = torch.zeros(rows, hidden.shape[1], dtype=torch.float32)
    for row, (start, stop) in enumerate(zip(first.tolist(), last.tolist())):
        if stop >= start:
            out[row] = hidden[start:stop + 1].amax(dim=0)
    return out


def normalize_rows(rows: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """float32 rows [R, H], the ones whose flag [R] is non-zero L2-normalized as
    worker/postprocess.py does it: x / max(|x|, 1e-12), so a zero row stays zero. A division,
    not rsqrt: it rounds once, so device rows equal the CPU's to float32 rounding."""
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True).clamp_min(1e-12)
    return torch.where(flags.unsqueeze(1) != 0, rows / norms, rows)
