"""One batch as the engine sees it: flat token ids plus the index arrays, all built on the CPU.

The batcher hands over spans of sequences; `pack` lays them end to end (no padding) and says,
for every output row, which tokens it pools. A row is usually a whole text, but a contextual-
chunk request pools several rows out of one sequence, so rows and sequences are kept apart:

    ids, positions, pool_index : [T]    token id, position inside its sequence, output row (R = none)
    cu_seqlens                 : [B+1]  sequence bounds, int32 from 0 (what varlen attention takes)
    pool_first, pool_last      : [R]    first and last token of each row's span (cls / last pooling)
    pool_count                 : [R]    tokens in each row's span (mean pooling)

Everything is int32 and built with numpy while the previous batch runs on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class PackedBatch:
    ids: np.ndarray
    positions: np.ndarray
    cu_seqlens: np.ndarray
    max_seqlen: int
    pool_index: np.ndarray
    pool_first: np.ndarray
    pool_last: np.ndarray
    pool_count: np.ndarray

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def rows(self) -> int:
        return len(self.pool_first)


@dataclass(frozen=True, slots=True)
class RowSpans:
    """The token spans that become output rows, row by row: row r pools tokens start[r] to
    stop[r] - 1 of the batch's sequence seq[r]. seq is non-decreasing; the spans of a sequence
    are disjoint and in order (contextual chunks, CHUNK_MEAN windows, one token each for token
    vectors). Arrays, not lists: a batch of token vectors has a row per token."""

    seq: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    @classmethod
    def of(cls, per_sequence: list[list[tuple[int, int]]]) -> RowSpans:
        """From each sequence's (start, stop) spans (tests and tools)."""
        flat = np.array([(i, a, b) for i, spans in enumerate(per_sequence) for a, b in spans],
                        dtype=np.int64).reshape(-1, 3)
        return cls(flat[:, 0], flat[:, 1], flat[:, 2])

    @classmethod
    def concat(cls, parts: list[RowSpans], sequences: list[int]) -> RowSpans:
        """The spans of batches laid end to end, parts[i] over sequences[i] sequences."""
        base = np.cumsum([0, *sequences[:-1]])
        return cls(np.concatenate([p.seq + b for p, b in zip(parts, base)]),
                   np.concatenate([p.start for p in parts]), np.concatenate([p.stop for p in parts]))


def pack(sequences: list[np.ndarray], rows: RowSpans | None = None) -> PackedBatch:
    """sequences: token ids of each text; rows: the token spans that each become one output row
    (None: every sequence is one row over all its tokens)."""
    if len(sequences) == 1 and rows is None:
        return _pack_one(sequences[0])  # a query: the common latency-bound case, kept cheap
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int32, count=len(sequences))
    cu = np.zeros(len(sequences) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    total = int(cu[-1])
    ids = np.concatenate(sequences).astype(np.int32, copy=False) if sequences else np.empty(0, np.int32)
    # Position inside each sequence: a global arange minus each token's sequence start.
    positions = np.arange(total, dtype=np.int32) - np.repeat(cu[:-1], lengths)
    if rows is None:
        first, last, count = cu[:-1].copy(), cu[1:] - 1, lengths.copy()
        pool_index = np.repeat(np.arange(len(sequences), dtype=np.int32), lengths)
    else:
        first, count, pool_index = _span_rows(cu, rows, total)
        last = first + count - 1
    return PackedBatch(ids, positions, cu, int(lengths.max(initial=0)), pool_index, first, last, count)


def _span_rows(cu: np.ndarray, rows: RowSpans, total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each row's first token in the batch, its token count, each token's row): tokens in no span
    pool into a dropped row (R). One vectorized pass: a batch of token vectors has a row per token."""
    starts = (cu[rows.seq] + rows.start).astype(np.int32)
    counts = (rows.stop.astype(np.int64) - rows.start.astype(np.int64)).astype(np.int32)
    if np.any(counts <= 0):
        raise ValueError("every pooled span needs at least one token")
    n_rows = len(starts)
    pool_index = np.full(total, n_rows, dtype=np.int32)
    before = np.cumsum(counts) - counts  # tokens of the rows before each row
    covered = np.repeat(starts - before, counts) + np.arange(int(counts.sum()))
    pool_index[covered] = np.repeat(np.arange(n_rows, dtype=np.int32), counts)
    return starts, counts, pool_index


def split(batch: PackedBatch, parts: int) -> list[PackedBatch]:
    """The batch cut at sequence bounds into at most `parts` batches of about equal tokens, in
    order: their rows, one after the other, are the batch's rows (a row never spans two
    sequences). One batch, unchanged, where it has a single sequence."""
    cu = batch.cu_seqlens
    sequences = len(cu) - 1
    if parts < 2 or sequences < 2:
        return [batch]
    inner = cu[1:-1].astype(np.int64)  # the bounds a cut may take, between sequences 1..n-1
    total = int(cu[-1])
    cuts = sorted({int(np.abs(inner - total * k / parts).argmin()) + 1 for k in range(1, parts)})
    bounds = [0, *cuts, sequences]
    rows = batch.rows
    pieces = []
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        a, b = int(cu[s0]), int(cu[s1])
        r0, r1 = (int(np.searchsorted(batch.pool_first, x)) for x in (a, b))
        index = batch.pool_index[a:b]
        # Tokens of no row point past the rows (R); in the piece, past its own.
        index = np.where(index == rows, r1 - r0, index - r0).astype(np.int32)
        piece_cu = (cu[s0:s1 + 1] - a).astype(np.int32)
        pieces.append(PackedBatch(batch.ids[a:b], batch.positions[a:b], piece_cu, int(np.diff(piece_cu).max()),
                                  index, batch.pool_first[r0:r1] - a, batch.pool_last[r0:r1] - a,
                                  batch.pool_count[r0:r1]))
    return pieces


def padded(batch: PackedBatch, multiple: int) -> PackedBatch:
    """The batch with a padding sequence appended so that its tokens are a multiple of `multiple`
    (the batch itself where they are): token 0 at positions 0.., pooled into no row."""
    extra = -batch.tokens % multiple
    if not extra:
        return batch
    ids = np.concatenate([batch.ids, np.zeros(extra, np.int32)])
    positions = np.concatenate([batch.positions, np.arange(extra, dtype=np.int32)])
    cu = np.append(batch.cu_seqlens, batch.cu_seqlens[-1] + extra).astype(np.int32)
    index = np.concatenate([batch.pool_index, np.full(extra, batch.rows, np.int32)])
    return PackedBatch(ids, positions, cu, max(batch.max_seqlen, extra), index, batch.pool_first, batch.pool_last,
                       batch.pool_count)


def warm_up_batch() -> PackedBatch:
    """Two tiny texts: what engines run once before the worker says READY."""
    return pack([np.array([1, 2], np.int32), np.array([3, 4], np.int32)])


# A query's index arrays depend only on its length: made once per length up to this many tokens
# (at most 64 sets of six arrays of at most 64 values) and shared by every batch of that length,
# so a lone query does not build them on its way to the GPU. Batches never write them.
ONE_TEXT_SHARED_MAX = 64
_ONE_TEXT: dict[int, tuple[np.ndarray, ...]] = {}


def _one_text_arrays(n: int) -> tuple[np.ndarray, ...]:
    """positions, cu_seqlens, pool_index, pool_first, pool_last, pool_count of one text of n tokens."""
    arrays = _ONE_TEXT.get(n)
    if arrays is None:
        arrays = (np.arange(n, dtype=np.int32), np.array([0, n], dtype=np.int32), np.zeros(n, dtype=np.int32),
                  np.zeros(1, dtype=np.int32), np.array([n - 1], dtype=np.int32), np.array([n], dtype=np.int32))
        if n <= ONE_TEXT_SHARED_MAX:
            _ONE_TEXT[n] = arrays
    return arrays


def _pack_one(seq: np.ndarray) -> PackedBatch:
    n = len(seq)
    positions, cu, index, first, last, count = _one_text_arrays(n)
    return PackedBatch(np.asarray(seq, dtype=np.int32), positions, cu, n, index, first, last, count)
