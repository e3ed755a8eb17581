"""Token-budget batching over packed sequences: requests in, batches of sequence spans out.

A batch is a list of (job, start, stop) spans: sequences start..stop-1 of one job. Jobs are
served first come, first served; a request with many texts may be split across batches, and a
batch may hold the tail of one request and the head of the next. No padding is ever added.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from shared_mem.records import RequestRecord


@dataclass(slots=True)
class Job:
    """One request inside the worker, collecting its pooled rows as batches finish."""

    rec: RequestRecord
    offsets: np.ndarray  # start of each sequence in rec.ids, plus the end: [n + 1]
    pooled: np.ndarray | None = None  # [n, hidden] float32, allocated by the first batch
    next_seq: int = 0                 # first sequence not yet handed to a batch
    done_seqs: int = 0
    first_start_ns: int = 0
    last_start_ns: int = 0
    last_end_ns: int = 0

    @classmethod
    def of(cls, rec: RequestRecord) -> "Job":
        offsets = np.zeros(len(rec.lengths) + 1, dtype=np.int64)
        np.cumsum(rec.lengths, out=offsets[1:])
        return cls(rec, offsets)

    @property
    def n_seqs(self) -> int:
        return len(self.rec.lengths)

    def tokens(self, start: int, stop: int) -> int:
        return int(self.offsets[stop] - self.offsets[start])


@dataclass(slots=True)
class Batcher:
    max_batch_tokens: int
    jobs: deque = field(default_factory=deque)
    queued_tokens: int = 0

    def add(self, job: Job) -> None:
        self.jobs.append(job)
        self.queued_tokens += job.tokens(0, job.n_seqs)

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def next_batch(self) -> list[tuple[Job, int, int]]:
        """Take sequences in arrival order until the next one would pass the token budget.

        A single sequence is never longer than the budget (the config guarantees the model's
        limit fits), so every batch holds at least one sequence and the queue always drains.
        """
        spans: list[tuple[Job, int, int]] = []
        budget = self.max_batch_tokens
        while self.jobs:
            job = self.jobs[0]
            start = stop = job.next_seq
            while stop < job.n_seqs:
                need = int(job.rec.lengths[stop])
                if need > budget and (spans or stop > start):
                    break
                budget -= need
                stop += 1
            if stop > start:
                spans.append((job, start, stop))
                self.queued_tokens -= job.tokens(start, stop)
                job.next_seq = stop
            if job.next_seq < job.n_seqs:
                break  # budget spent inside this job
            self.jobs.popleft()
        return spans
