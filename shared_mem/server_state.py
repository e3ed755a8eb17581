"""The server's shared figures in one small POSIX shared-memory segment: what the supervisor,
every frontend and every worker must see of each other, without messages.

Layout (little-endian, one 64-byte cache line per writer, so no two writers share a line)::

    line 0              magic "POLLENST" u64 | version u32 | frontends u32 | workers u32   (create())
    lines 1 + 2w, 2 + 2w  worker w:  heartbeat_ns u64 | ready u32 | pid u32 | batches u64 |  (worker w)
                                   phase_ns u64 [PHASES] | (next line) graph counts u64 [GRAPH_COUNTS]
    after them         queued u64 [F][W]: frontend f's tokens routed to worker w            (frontend f)
    after that         backlog u64 [F][W]: its requests for worker w waiting for ring space (frontend f)
                       (each region starts on a line; a frontend writes only its own row)

- heartbeat_ns (CLOCK_MONOTONIC) is stored by the worker's loop at every turn, busy or idle (an
  idle worker turns at least once a second), so a heartbeat older than --worker-hang-timeout
  means the worker makes no progress: the supervisor kills it and it is restarted like after a
  crash. ready is 1 from the worker's READY to its exit; batches counts the batches it ran;
  phase_ns is the time its loop has spent in each phase (PHASES), so /metrics shows whether a
  worker's one thread is the bottleneck and where its time goes. The graph counts (GRAPH_COUNTS,
  CUDA only) say how its batches ran: eagerly for want of a graph, padded into a larger captured
  graph, and how many graphs it holds.
- Each frontend stores its own row of queued tokens (admitted and not yet answered, per worker);
  admission (--max-queued-tokens) and routing read the sum of all rows: whole-server figures.

Every value is one aligned 8- or 4-byte store on x86-64, so a reader sees either the old or the
new value, never a torn one; a row summed while it changes is off by at most the change in flight.
"""
from __future__ import annotations

import mmap
import os
import struct
import time

import numpy as np

from pollen.shared_mem.segment import close_mapping, create_segment, map_segment, unlink_segment

_MAGIC = int.from_bytes(b"POLLENST", "little")
_VERSION = 2
_HEAD = struct.Struct("<QIII")
LINE = 64
_WORKER_WORDS = 2 * LINE // 8  # u64 words per worker (two lines): heartbeat, (ready, pid), batches, phases; counts
_COUNTS_AT = LINE // 8  # the graph counts start the worker's second line
# The worker loop's phases: reading requests (rings, control, deadlines), launching batches
# (batching, planning, packing, the engine's launch), answering them (records), and waiting.
PHASES = ("requests", "launch", "answer", "wait")
# Batches of a graph-sized bucket that ran eagerly (no graph captured for it, none larger fits),
# batches run in a larger captured graph (padded), and graphs captured (both lanes).
GRAPH_COUNTS = ("eager_batches", "padded_batches", "graphs")


def _workers_end(workers: int) -> int:
    """Byte offset just past the worker lines (where the frontends' regions begin)."""
    return LINE + workers * _WORKER_WORDS * 8


def _region_bytes(frontends: int, workers: int) -> int:
    """Bytes of one [frontends][workers] u64 region, whole lines."""
    return -(-frontends * workers * 8 // LINE) * LINE


class ServerState:
    def __init__(self, name: str, mm: mmap.mmap):
        self.name = name
        self._mm = mm
        _, _, self.frontends, self.workers = _HEAD.unpack_from(mm)
        cells = self.frontends * self.workers
        queued_at = _workers_end(self.workers)
        backlog_at = queued_at + _region_bytes(self.frontends, self.workers)
        self._u64 = np.frombuffer(mm, dtype=np.uint64)
        self._u32 = np.frombuffer(mm, dtype=np.uint32)
        # queued[f, w]: frontend f's tokens routed to worker w (row f is frontend f's to write);
        # backlog[f, w]: its requests for worker w waiting for ring space. The memoryviews are
        # the same cells, flat: summing and storing through them costs a fraction of numpy's
        # per-call overhead, on every request.
        self.queued = self._u64[queued_at // 8:queued_at // 8 + cells].reshape(self.frontends, self.workers)
        self.backlog = self._u64[backlog_at // 8:backlog_at // 8 + cells].reshape(self.frontends, self.workers)
        self._queued = memoryview(mm)[queued_at:queued_at + 8 * cells].cast("Q")
        self._backlog = memoryview(mm)[backlog_at:backlog_at + 8 * cells].cast("Q")

    @classmethod
    def size_for(cls, frontends: int, workers: int) -> int:
        return _workers_end(workers) + 2 * _region_bytes(frontends, workers)

    @classmethod
    def create(cls, frontends: int, workers: int, prefix: str = "pollen") -> ServerState:
        name, mm = create_segment(cls.size_for(frontends, workers), prefix)
        _HEAD.pack_into(mm, 0, _MAGIC, _VERSION, frontends, workers)
        return cls(name, mm)

    @classmethod
    def attach(cls, name: str) -> ServerState:
        mm = map_segment(name, "server state", _HEAD.size)
        magic, version, _, _ = _HEAD.unpack_from(mm)
        if magic != _MAGIC or version != _VERSION:
            mm.close()
            raise ValueError(f"{name} is not a pollen server state v{_VERSION}")
        return cls(name, mm)

    # ---- worker lines (each written by its worker only) ----

    def _word(self, worker: int) -> int:
        return LINE // 8 + worker * _WORKER_WORDS

    def beat(self, worker: int, batches: int | None = None) -> None:
        """The worker's loop turned: store the time (and its batch count)."""
        at = self._word(worker)
        self._u64[at] = time.monotonic_ns()
        if batches is not None:
            self._u64[at + 2] = batches

    def set_ready(self, worker: int, ready: bool) -> None:
        at = 2 * self._word(worker) + 2  # the u32 after the heartbeat
        self._u32[at + 1] = os.getpid()
        self._u32[at] = 1 if ready else 0

    def heartbeat_ns(self, worker: int) -> int:
        return int(self._u64[self._word(worker)])

    def ready(self, worker: int) -> bool:
        return bool(self._u32[2 * self._word(worker) + 2])

    def phase_view(self, worker: int) -> np.ndarray:
        """Worker `worker`'s phase_ns words, writable (the worker adds to them)."""
        at = self._word(worker) + 3
        return self._u64[at:at + len(PHASES)]

    def counts_view(self, worker: int) -> np.ndarray:
        """Worker `worker`'s graph counts (GRAPH_COUNTS), writable (the worker stores them)."""
        at = self._word(worker) + _COUNTS_AT
        return self._u64[at:at + len(GRAPH_COUNTS)]

    def batches(self, worker: int) -> int:
        return int(self._u64[self._word(worker) + 2])

    def clear_worker(self, worker: int) -> None:
        """Forget a dead worker's line (the supervisor, before its successor starts)."""
        at = self._word(worker)
        self._u64[at:at + _WORKER_WORDS] = 0

    # ---- queued tokens ----

    def publish(self, frontend: int, worker: int, queued: int, backlog: int) -> None:
        """Frontend `frontend`'s queued tokens and backlog for worker `worker`."""
        at = frontend * self.workers + worker
        self._queued[at] = queued
        self._backlog[at] = backlog

    def queued_total(self) -> int:
        return sum(self._queued)

    def queued_by(self, frontend: int) -> int:
        """Frontend `frontend`'s queued tokens, over every worker."""
        return sum(self._queued[frontend * self.workers:(frontend + 1) * self.workers])

    def queued_on(self, worker: int) -> int:
        return sum(self._queued[worker::self.workers])

    def backlog_total(self) -> int:
        return sum(self._backlog)

    def clear_frontend(self, frontend: int) -> None:
        """Forget a dead frontend's row (the supervisor, before its successor starts)."""
        self.queued[frontend] = 0
        self.backlog[frontend] = 0

    def close(self) -> None:
        self._queued.release()
        self._backlog.release()
        self.queued = self.backlog = self._u64 = self._u32 = None
        close_mapping(self._mm)

    def unlink(self) -> None:
        unlink_segment(self.name)
