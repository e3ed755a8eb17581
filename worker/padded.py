"""A packed batch (worker/packed.py) as right-padded groups, for an engine whose graph takes [n, L]
inputs (worker/onnx_engine.py), and its rows pooled from their output.

The batcher packs sequences end to end; ONNX Runtime's attention wants a rectangle. Padding the
whole batch to its longest text would make a batch of mixed lengths several times its work, and
one run a sequence would pay a run's fixed cost (every weight read, every op's launch) that many
times. So the sequences are sorted by length and cut into groups, each padded to its own longest:
a group costs RUN_TOKENS (the fixed cost, in tokens of work) plus n x L, and `groups` takes the cut
of least total (a dynamic program over the distinct lengths), so texts of one length stay one
run and a batch of mixed lengths is padded by little.

Rows are spans of tokens inside one sequence, so each is a contiguous run of its group's flat
[n x L, hidden] output too: `pool` takes them straight from there, for every pooling mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pollen.worker.packed import PackedBatch

# A run's fixed cost in tokens of work: what one text's run costs beyond its tokens (reading every
# weight, the ops' dispatch), as a query's time over the time a token takes in a large batch.
RUN_TOKENS = 16


@dataclass(slots=True)
class PaddedGroup:
    ids: np.ndarray      # [n, L] int32: each sequence from the left, zeros after it
    lengths: np.ndarray  # [n] int32: each sequence's tokens
    rows: np.ndarray     # the batch's rows whose spans lie in this group's sequences
    starts: np.ndarray   # each such row's first token in the group's flat [n x L] output
    counts: np.ndarray   # each such row's tokens


def groups(batch: PackedBatch, run_tokens: int = RUN_TOKENS) -> list[PaddedGroup]:
    """The batch's sequences in groups of similar length, longest first; every row in exactly one."""
    cu = batch.cu_seqlens.astype(np.int64)
    lengths = np.diff(cu)
    if len(lengths) == 1:  # a query: the whole batch, nothing to sort
        return [PaddedGroup(batch.ids.reshape(1, -1), lengths.astype(np.int32), np.arange(batch.rows),
                            batch.pool_first.astype(np.int64), batch.pool_count.astype(np.int64))]
    order = np.argsort(-lengths, kind="stable")
    row_seq = np.searchsorted(cu, batch.pool_first, side="right") - 1  # each row's sequence
    place = np.empty(len(lengths), np.int64)  # each sequence's first token in its group's flat output
    group_of = np.empty(len(lengths), np.int64)
    out = []
    bounds = cuts(lengths[order], run_tokens)
    for g, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        seqs = order[a:b]
        lens, width = lengths[seqs], int(lengths[seqs[0]])
        ids = np.zeros((len(seqs), width), np.int32)
        before = np.cumsum(lens) - lens  # tokens of the group's sequences before each
        inside = np.arange(int(lens.sum())) - np.repeat(before, lens)  # each token's place in its sequence
        ids.reshape(-1)[np.repeat(np.arange(len(seqs)) * width, lens) + inside] = \
            batch.ids[np.repeat(cu[seqs], lens) + inside]
        place[seqs], group_of[seqs] = np.arange(len(seqs)) * width, g
        out.append(PaddedGroup(ids, lens.astype(np.int32), np.empty(0, np.int64), np.empty(0), np.empty(0)))
    for g, group in enumerate(out):
        rows = np.flatnonzero(group_of[row_seq] == g)
        seq = row_seq[rows]
        group.rows, group.counts = rows, batch.pool_count[rows].astype(np.int64)
        group.starts = place[seq] + batch.pool_first[rows] - cu[seq]
    return out


def cuts(lengths: np.ndarray, run_tokens: int) -> list[int]:
    """Where groups of `lengths` (sorted longest first) begin, and its end: the cut that least
    costs, each group run_tokens plus its count times its longest. Sequences of one length never
    part (a group that ends inside them would be better off giving them to the next)."""
    values, counts = np.unique(lengths, return_counts=True)
    values, counts = values[::-1], counts[::-1]  # longest first
    seen = np.concatenate([[0], np.cumsum(counts)])  # sequences before each distinct length
    best = np.zeros(len(values) + 1)
    start = np.zeros(len(values) + 1, np.int64)
    for j in range(1, len(values) + 1):  # best[j]: the first j distinct lengths; the last group from i
        costs = best[:j] + run_tokens + (seen[j] - seen[:j]) * values[:j]
        i = int(np.argmin(costs))
        best[j], start[j] = costs[i], i
    bounds, j = [], len(values)
    while j > 0:
        bounds.append(int(seen[j]))
        j = start[j]
    return [0, *bounds[::-1]]


def pool(hidden: np.ndarray, starts: np.ndarray, counts: np.ndarray, mode: str) -> np.ndarray:
    """Rows pooled from a group's output hidden [n, L, H] (any float dtype): each row's tokens are
    flat[starts : starts + counts] of its flat [n x L, H] form. float32 [rows, H]. The modes and
    their arithmetic are worker/models/pooling.py's: a float32 sum in token order for mean."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if mode == "cls":
        return flat[starts].astype(np.float32)
    if mode == "last":
        return flat[starts + counts - 1].astype(np.float32)
    if len(starts) == 0:
        return np.zeros((0, flat.shape[1]), np.float32)
    # reduceat over interleaved (start, end) bounds sums (or maxes) each row's span at the even
    # places; an end at the array's end must be left off (the last span then runs to the end), so
    # that row goes last.
    order = np.argsort(starts + counts == len(flat), kind="stable")
    bounds = np.stack([starts[order], (starts + counts)[order]], axis=1).reshape(-1)
    if bounds[-1] == len(flat):
        bounds = bounds[:-1]
    reduce = np.add if mode == "mean" else np.maximum if mode == "max" else None
    if reduce is None:
        raise ValueError(f"unknown pooling mode {mode!r}")
    pooled = np.empty((len(starts), flat.shape[1]), np.float32)
    pooled[order] = reduce.reduceat(flat.astype(np.float32, copy=False), bounds, axis=0)[::2]
    if mode == "mean":
        pooled /= counts[:, None].astype(np.float32)
    return pooled
