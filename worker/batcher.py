"""Token-budget batching over packed sequences, in two priority lanes: requests in, batches out.

A batch is a list of (job, start, stop) spans: sequences start..stop-1 of one job. A request with
many sequences may be split across batches, and a batch may hold the tail of one request and the
head of the next. No padding.

Fair share within a lane: a batch is filled in two passes. First every queued request gets up to
a quantum (a quarter of the budget, at least its next sequence), the least served first: new
requests in arrival order, then begun ones by the tokens they have had. Then what is left goes
first come, first served. So a short request goes into the next batch even behind a request of
thousands of windows, whose windows fill the rest of each batch; equal short requests keep their
arrival order.
A lane holding one request that fits whole skips the passes (they would give the same batch):
the lone query's case.

Lanes (docs/design/requests.md, "Priority lanes"). On CUDA the engine runs the two lanes side by
side, each on a stream of its own priority, and asks for one lane's batch at a time
(`next_batch(lane)`; bulk batches up to `bulk_batch_tokens`). An engine that runs one batch at a
time (the CPU) takes mixed batches (`next_batch()`): interactive work goes first, and a batch
holding interactive work takes exactly one bulk sequence beside it (when bulk waits), so bulk is
never starved: the interactive fill stops short of that sequence. A batch without interactive
work takes bulk work up to `bulk_batch_tokens` (0: the whole budget). An interactive request
arriving while the worker is busy therefore waits for at most the bulk batch being run (the cap
bounds it) and then runs with one bulk sequence at most beside it.

Rows are capped too (`max_batch_rows`, 0: none), the same way as tokens: a batch's answer
record holds every row it pools, and the answers of requests begun in earlier batches, and must
fit the response ring (shared_mem/records.py, max_batch_rows; Job.record_rows). Only batches of
very short texts or tiny chunks ever meet that cap.

Requests that have not reached the model can leave the queue: `cancel` (the client left) and
`expire` (the deadline passed). A request whose first sequence was batched is finished as usual.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pollen.common.request import LANES, Lane
from pollen.shared_mem.records import RequestRecord, RowPlan
from pollen.worker.packed import RowSpans

INTERACTIVE, BULK = LANES  # Lane's members, bound once: each Lane.X costs an enum lookup per batch
QUANTUM_DIVISOR = 4  # a request's first-pass share of a batch: a quarter of its budget
_ONE_ROW = np.arange(2, dtype=np.int64)  # row_offsets of a one-sequence, one-row request (read only)


@dataclass(slots=True, eq=False)  # compared (and hashed) by identity: one object per request
class Job:
    """One request in the worker: its record, how far batches have taken it, and what its answer
    has gathered when its sequences run in several batches."""

    rec: RequestRecord
    offsets: np.ndarray      # start of each sequence in rec.ids, plus the end: [n_seqs + 1]
    row_offsets: np.ndarray  # first row of each sequence, plus the end: [n_seqs + 1]
    source: int = 0          # the frontend it came from (the link its answer goes back on)
    rows_are_outputs: bool = True  # each row its own output, in order, weight 1 (no combine)
    next_seq: int = 0        # first sequence not yet handed to a batch
    # Set by the first of its batches only when it spans several (worker/batch_answer.py, fill):
    first_start_ns: int = field(init=False, repr=False)
    pooled: np.ndarray | None = field(init=False, repr=False)  # [n_rows, hidden] float32, batch by batch
    failed: bool = field(init=False, repr=False)  # a batch holding some of it failed: answered INTERNAL

    @classmethod
    def of(cls, rec: RequestRecord, source: int = 0) -> Job:
        n = len(rec.lengths)
        if n == 1 and rec.rows is None:  # a query: the common case, kept cheap
            return cls(rec, np.array((0, int(rec.lengths[0])), dtype=np.int64), _ONE_ROW, source)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(rec.lengths, out=offsets[1:])
        if rec.rows is None:
            row_offsets = np.arange(n + 1, dtype=np.int64)
        else:
            row_offsets = np.searchsorted(rec.rows.seq, np.arange(n + 1), side="left").astype(np.int64)
        return cls(rec, offsets, row_offsets, source, rec.rows is None or _rows_are_outputs(rec.rows))

    @property
    def n_seqs(self) -> int:
        return len(self.rec.lengths)

    @property
    def n_rows(self) -> int:
        return int(self.row_offsets[-1])

    def tokens(self, start: int, stop: int) -> int:
        return int(self.offsets[stop] - self.offsets[start])

    def record_rows(self, seq: int, start: int) -> int:
        """What sequence `seq` costs a batch that takes this job from sequence `start` on, in rows
        of the batch's answer record: the rows it pools and, when it ends a request begun in an
        earlier batch, that request's outputs, whose answer goes into this batch's record."""
        rows = int(self.row_offsets[seq + 1] - self.row_offsets[seq])
        if start > 0 and seq + 1 == self.n_seqs:
            rows += self.rec.n_out
        return rows

    def row_spans(self, a: int, b: int) -> RowSpans:
        """The token spans of sequences a..b-1 that each become one pooled row, their sequences
        counted from a."""
        rows = self.rec.rows
        if rows is None:
            return RowSpans(np.arange(b - a), np.zeros(b - a, np.int64), self.offsets[a + 1:b + 1] - self.offsets[a:b])
        r0, r1 = self.row_offsets[a], self.row_offsets[b]
        return RowSpans(rows.seq[r0:r1].astype(np.int64) - a, rows.start[r0:r1], rows.stop[r0:r1])


def _rows_are_outputs(rows: RowPlan) -> bool:
    """Contextual chunks and token vectors: row i is output i, alone (CHUNK_MEAN windows are not)."""
    return bool((rows.out == np.arange(len(rows.out))).all() and (rows.weight == 1).all())


def least_served(jobs: list[Job]) -> list[Job]:
    """Requests not yet begun in arrival order, then those begun by the tokens they have had."""
    begun = sorted((job for job in jobs if job.next_seq), key=lambda job: job.tokens(0, job.next_seq))
    return [job for job in jobs if not job.next_seq] + begun


@dataclass(slots=True)
class Batcher:
    max_batch_tokens: int
    bulk_batch_tokens: int = 0  # 0: no cap beyond max_batch_tokens
    max_batch_rows: int = 0     # 0: no cap
    lanes: tuple = field(default_factory=lambda: (deque(), deque()))
    queued_tokens: int = 0
    with_deadline: int = 0  # queued jobs that carry a deadline: expire() scans only when some do

    def add(self, job: Job, lane: Lane | None = None) -> None:
        """Queue `job` in its request's lane, or in `lane` (the worker's choice: worker/loop.py run_lane)."""
        self.lanes[job.rec.options.lane if lane is None else lane].append(job)
        self.queued_tokens += job.tokens(0, job.n_seqs)
        self.with_deadline += job.rec.options.deadline_ns != 0

    def __bool__(self) -> bool:
        return bool(self.lanes[INTERACTIVE] or self.lanes[BULK])

    def _remove(self, lane: deque, job: Job, batched: int = 0) -> None:
        lane.remove(job)
        self.queued_tokens -= job.tokens(batched, job.n_seqs)
        self.with_deadline -= job.rec.options.deadline_ns != 0

    def cancel(self, req_id: int, source: int = 0) -> Job | None:
        """Take out a request that has not reached the model; None if it has (or is unknown)."""
        for lane in self.lanes:
            for job in lane:
                if job.rec.req_id == req_id and job.source == source:
                    if job.next_seq:
                        return None
                    self._remove(lane, job)
                    return job
        return None

    def drop_source(self, source: int) -> list[Job]:
        """Take out every request of a frontend that is gone, batched in part or not."""
        gone = [(lane, job) for lane in self.lanes for job in lane if job.source == source]
        for lane, job in gone:
            self._remove(lane, job, job.next_seq)
        return [job for _, job in gone]

    def expire(self, now_ns: int) -> list[Job]:
        """Take out the requests whose deadline passed before any of their sequences was batched."""
        if not self.with_deadline:
            return []
        gone = [(lane, job) for lane in self.lanes for job in lane
                if job.next_seq == 0 and job.rec.options.expired(now_ns)]
        for lane, job in gone:
            self._remove(lane, job)
        return [job for _, job in gone]

    def next_batch(self, lane: Lane | None = None) -> list[tuple[Job, int, int]]:
        """The next batch: of one lane (INTERACTIVE, or BULK up to bulk_batch_tokens), for an
        engine that runs the lanes side by side; or, with `lane` None, of both (the mixed rule in
        the module docstring), for an engine that runs one batch at a time.

        A single sequence is never longer than the budget (the config guarantees the model's
        limit fits) nor costs more rows than the row cap (the frontend checks it against the most
        outputs a request may have, plus one), so every batch holds at least one sequence and the
        queues always drain.
        """
        if lane is None:
            return self._mixed()
        spans: list[tuple[Job, int, int]] = []
        budget = self.max_batch_tokens if lane == INTERACTIVE else self.bulk_batch_tokens or self.max_batch_tokens
        self._take(self.lanes[lane], budget, self.max_batch_rows or 1 << 62, spans)
        return spans

    def _mixed(self) -> list[tuple[Job, int, int]]:
        spans: list[tuple[Job, int, int]] = []
        interactive, bulk = self.lanes
        reserve = reserve_rows = 0
        if bulk:  # keep room for one bulk sequence (the one _take would take first): bulk is never starved
            head = least_served(list(bulk))[0]
            reserve = head.tokens(head.next_seq, head.next_seq + 1)
            reserve_rows = head.record_rows(head.next_seq, head.next_seq)
        # left < reserve only when a lone interactive sequence overflowed the reserve (a tiny budget).
        left, rows_left = self._take(interactive, self.max_batch_tokens - reserve,
                                     (self.max_batch_rows or 1 << 62) - reserve_rows, spans)
        left, rows_left = left + reserve, rows_left + reserve_rows
        if bulk and left > 0:
            # Beside interactive work, bulk gets its one sequence only: the interactive requests'
            # latency is then this batch, not this batch plus a bulk batch's worth of tokens.
            budget = 0 if spans else min(left, self.bulk_batch_tokens or self.max_batch_tokens)
            self._take(bulk, budget, rows_left, spans, at_least_one=left >= reserve and rows_left >= reserve_rows)
        return spans

    def _take(self, lane: deque, budget: int, rows_left: int, spans: list,
              at_least_one: bool = False) -> tuple[int, int]:
        """Move sequences of `lane` into `spans` while they fit `budget` tokens and `rows_left`
        rows, in the two passes of fair share (module docstring). Returns what is left of both
        (negative when a first sequence that had to go in was larger)."""
        if not lane:
            return budget, rows_left
        if len(lane) == 1 and (left := self._take_lone_request(lane, budget, rows_left, spans)) is not None:
            return left
        jobs = list(lane)
        quantum = max(1, budget // QUANTUM_DIVISOR)
        stops: dict[Job, int] = {}
        force = at_least_one or not spans  # the very first sequence of a batch always goes in
        for order, cap in ((least_served(jobs), quantum), (jobs, None)):
            for job in order:
                if budget <= 0 and not force:
                    break
                start = job.next_seq
                stop = stops.get(job, start)
                got = job.tokens(start, stop)
                while stop < job.n_seqs:
                    need, rows = job.tokens(stop, stop + 1), job.record_rows(stop, start)
                    over = cap is not None and got > 0 and got + need > cap
                    if not force and (need > budget or rows > rows_left or over):
                        break
                    budget, rows_left, got, stop, force = budget - need, rows_left - rows, got + need, stop + 1, False
                stops[job] = stop
                if cap is None and stop < job.n_seqs:
                    break  # first come, first served: the first request that does not fit ends the batch
        self._commit(lane, jobs, stops, spans)
        return budget, rows_left

    def _take_lone_request(self, lane: deque, budget: int, rows_left: int, spans: list) -> tuple[int, int] | None:
        """The lane's only request, whole, when it is not begun and all of it fits: what the two
        passes give then, without their cost (a lone query's case); returns what
        is left of both, as _take does. None, and nothing taken, otherwise."""
        job = lane[0]
        tokens = job.tokens(0, job.n_seqs)
        if job.next_seq or tokens > budget or job.n_rows > rows_left:
            return None
        self._commit(lane, [job], {job: job.n_seqs}, spans)
        return budget - tokens, rows_left - job.n_rows

    def _commit(self, lane: deque, jobs: list[Job], stops: dict[Job, int], spans: list) -> None:
        """Hand the taken sequences to the batch, in arrival order; drop finished jobs from the lane."""
        finished = 0
        for job in jobs:
            stop = stops.get(job, job.next_seq)
            if stop > job.next_seq:
                spans.append((job, job.next_seq, stop))
                self.queued_tokens -= job.tokens(job.next_seq, stop)
                job.next_seq = stop
            finished += job.next_seq >= job.n_seqs
        if finished == len(lane):  # the lane is empty now (a lone query's case): no sorting out
            self.with_deadline -= sum(job.rec.options.deadline_ns != 0 for job in lane)
            lane.clear()
        elif finished:
            keep = [job for job in lane if job.next_seq < job.n_seqs]
            self.with_deadline -= sum(job.rec.options.deadline_ns != 0 for job in lane if job.next_seq >= job.n_seqs)
            lane.clear()
            lane.extend(keep)
