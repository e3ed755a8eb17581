"""What a CPU engine is beside its model (worker/eager_engine.py runs torch's): how a batch is
spread over the worker's threads, and how its rows reach the caller. No torch is imported here.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pollen.common.request import Lane
from pollen.worker.packed import PackedBatch, pack, split, warm_up_batch
from pollen.worker.thread_choice import LEARN_TOKENS, ThreadChoice


class ReadyRows:
    """Rows computed already: the CPU engines' PendingRows."""

    __slots__ = ("rows",)

    def __init__(self, rows):
        self.rows = rows

    def done(self) -> bool:
        return True  # the worker answers it at once instead of after the next batch

    def result(self):
        return self.rows


class CpuEngine:
    """What the CPU engines share: how a batch is spread over the worker's threads, and how its
    rows reach the caller.

    A batch of many texts (LEARN_TOKENS tokens or more, two sequences or more) is cut at sequence
    bounds into one piece per thread (packed.split), and the pieces run at once, each on one
    thread: the calling one and `threads - 1` helpers. Each piece's forward then has no parallel
    region to share: its threads meet once, at the batch's end, instead of at the barrier of
    every op of every layer. On idle cores that beats an intra-op pool for such batches, and
    when other processes keep the cores busy it beats it by far: a thread that loses its core
    stalls only its own piece. Every other batch (a query, one long text) runs on one thread or on
    the pool, as worker/thread_choice.py chooses.

    A subclass gives `_rows(batch, threads)` (the batch's pooled rows, computed on `threads`
    threads of the calling thread's pool), `_join(parts)` (pieces' rows, in order, as one) and
    `_output(rows, normalize)` (float32 numpy rows as the caller gets them: through the head, or
    the flagged ones normalized).
    """

    side_by_side = False  # one batch at a time: the lanes mix in the batcher instead
    bulk_sms = 0

    def __init__(self, threads: int, adapt_threads: bool = True, pieces: bool = True):
        self.threads = ThreadChoice(threads, adapt_threads)
        self.pieces = threads
        self.helpers = (ThreadPoolExecutor(threads - 1, thread_name_prefix="pollen-piece")
                        if pieces and threads > 1 else None)

    def submit(self, batch: PackedBatch, out=None, normalize: np.ndarray | None = None,
               lane: Lane = Lane.INTERACTIVE) -> ReadyRows:
        tokens = len(batch.ids)
        pieces = split(batch, self.pieces) if tokens >= LEARN_TOKENS and self.helpers is not None else [batch]
        if len(pieces) > 1:
            return self._answer(self._pieces_rows(pieces), out, normalize)
        threads = self.threads.threads_for(tokens)
        started = time.perf_counter()
        rows = self._rows(batch, threads)
        self.threads.ran(threads, tokens, time.perf_counter() - started)
        return self._answer(rows, out, normalize)

    def _pieces_rows(self, pieces: list[PackedBatch]):
        """The pieces' pooled rows, in order: the first on this thread, the others on the helpers,
        each on one thread."""
        running = [self.helpers.submit(self._rows, piece, 1) for piece in pieces[1:]]
        first = self._rows(pieces[0], 1)
        return self._join([first, *(piece.result() for piece in running)])

    def _answer(self, rows, out, normalize: np.ndarray | None) -> ReadyRows:
        rows = self._output(rows, normalize)
        if out is None:
            return ReadyRows(rows)
        at = 0
        for part in out if isinstance(out, list) else [out]:
            np.copyto(part, rows[at:at + len(part)])
            at += len(part)
        return ReadyRows(out)

    def _rows(self, batch: PackedBatch, threads: int):
        raise NotImplementedError

    def _join(self, parts: list):
        raise NotImplementedError

    def _output(self, rows, normalize: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError

    def between_batches(self, interactive_waiting: bool, interactive_in_flight: bool, now_ns: int) -> bool:
        return False  # nothing runs beside the batches on the CPU

    def keep_counts_in(self, counts: np.ndarray) -> None:
        """Nothing to count: no graphs on the CPU."""

    def register_host_memory(self, address: int, nbytes: int) -> None:
        """Nothing to do: the CPU writes any memory directly."""

    def unregister_host_memory(self, address: int) -> None:
        """Nothing to do (see register_host_memory)."""

    def close(self) -> None:
        if self.helpers is not None:
            self.helpers.shutdown()

    def warm_up(self, budget_s: float = 0.0) -> None:
        self.submit(warm_up_batch()).result()
        if self.helpers is not None:  # the helpers' first calls too: a batch that is cut in pieces
            self.submit(pack([np.arange(1, 65, dtype=np.int32)] * (LEARN_TOKENS // 64))).result()
