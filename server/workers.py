"""Worker processes as the frontend sees them: start, feed, read answers, restart, stop.

Each WorkerHandle owns one worker process and its two rings, and keeps every request it sent
until the answer arrives. When the process dies, the handle starts a new one on fresh rings and
sends the unanswered requests again, in their original order: the client sees no error. A
request that was in flight in three crashes in a row is answered INTERNAL instead, so one
poisonous input cannot crash-loop a worker forever.

Drops (docs/architecture.md, "Deadlines and cancellation"): a request whose deadline passed or
whose client left is dropped before it reaches the model, here while it waits in the backlog, or
in the worker (the deadline travels in the record; a CANCEL record forgets a request not yet
batched), which answers it DEADLINE_EXCEEDED or CANCELLED. Each drop is counted once in
server.metrics.DROPPED: here for the backlog, on the worker's answer otherwise.

Everything here runs on the event loop thread: answers arrive through loop.add_reader on the
response ring's eventfd, deaths through a pidfd.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

import grpc

from pollen.common import status
from pollen.common.worker_config import WorkerConfig
from pollen.server import metrics
from pollen.server.config import ServeConfig
from pollen.server.errors import RequestError
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring

log = logging.getLogger("pollen.workers")

MAX_ATTEMPTS = 3
DEADLINE_SLACK_NS = 50_000_000


_DROP_REASONS = {records.DEADLINE_EXCEEDED: "deadline", records.CANCELLED: "cancelled"}


@dataclass(slots=True)
class Pending:
    record: bytes  # the request record, kept for a resend
    tokens: int
    future: asyncio.Future
    attempts: int = 0
    deadline_ns: int = 0  # CLOCK_MONOTONIC; 0: none
    priority: int = 0     # the backlog lane: 0 interactive, 1 bulk
    sent: bool = False    # in the ring (or the worker) rather than the backlog
    drop_reason: str = ""  # set when the frontend asked the worker to forget it


def dropped_error(reason: str) -> RequestError:
    if reason == "deadline":
        return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, status.DEADLINE_PASSED)
    return RequestError(grpc.StatusCode.CANCELLED, status.CANCELLED_BEFORE_MODEL)


class WorkerHandle:
    def __init__(self, index: int, cfg: ServeConfig):
        self.index = index
        self.cfg = cfg
        self.loop = asyncio.get_running_loop()
        self.inflight: dict[int, Pending] = {}
        # Request ids admitted but not yet in the ring, one FIFO lane per priority: the ring takes
        # interactive requests first, so bulk ones never hold them back here either.
        self.backlog: tuple[deque[int], deque[int]] = (deque(), deque())
        self.queued_tokens = 0
        self.proc: subprocess.Popen | None = None
        self.requests: Ring | None = None
        self.responses: Ring | None = None
        self.pidfd = -1
        self.ready = asyncio.Event()
        self.exited = asyncio.Event()
        self.stopping = False
        self.restarts = 0
        self.early_deaths = 0  # deaths before READY in a row, for the restart back-off
        self.info: dict = {}
        self.generation = 0  # bumped at each spawn, so timers of a dead worker stop
        # Called with (worker index, BatchReport) for every batch a worker ran (tests, tools).
        self.batch_listener = None

    # ---- life cycle ----

    def spawn(self) -> None:
        cfg = self.cfg
        self.requests = Ring.create(cfg.request_ring_bytes)
        self.responses = Ring.create(cfg.response_ring_bytes)
        gpu = cfg.gpu_list()[self.index] if cfg.device == "cuda" else -1
        wcfg = WorkerConfig(
            index=self.index, model=cfg.model, device=cfg.device, threads=cfg.worker_threads,
            max_batch_tokens=cfg.max_batch_tokens, bulk_batch_tokens=cfg.bulk_batch_tokens, parent_pid=os.getpid(),
            gpu=gpu, cpu_cores=core_share(self.index, cfg.workers), dtype=cfg.worker_dtype(),
            cuda_graphs=cfg.cuda_graphs == "on", graph_max_tokens=cfg.graph_max_tokens,
            pooling=cfg.pooling, attention=cfg.attention, spin_us=cfg.worker_spin_us,
            engine_options=cfg.engine_options(),
            request_ring=self.requests.name, request_fds=(self.requests.data_fd, self.requests.space_fd),
            response_ring=self.responses.name, response_fds=(self.responses.data_fd, self.responses.space_fd))
        fds = [*wcfg.request_fds, *wcfg.response_fds]
        self.proc = subprocess.Popen([sys.executable, "-m", "pollen.worker", wcfg.to_json()], pass_fds=fds)
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.exited.clear()
        self.responses.set_consumer_sleeping(True)
        self.loop.add_reader(self.responses.data_fd, self.read_answers)
        self.loop.add_reader(self.requests.space_fd, self.flush)
        self.loop.add_reader(self.pidfd, self.on_exit)
        self.generation += 1
        self.loop.call_later(Ring.WAIT_SLICE, self.tick, self.generation)
        log.info("worker %d started (pid %d)", self.index, self.proc.pid)

    async def start(self, timeout: float) -> None:
        self.spawn()
        ready = asyncio.ensure_future(self.ready.wait())
        died = asyncio.ensure_future(self.exited.wait())
        done, _ = await asyncio.wait({ready, died}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        died.cancel()
        if not self.ready.is_set():
            raise RuntimeError(f"worker {self.index} did not become ready "
                               f"({'it exited' if died in done else f'in {timeout} s'}); see its log above")

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to finish what it holds and exit; kill it if it does not."""
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None and self.requests is not None:
            deadline = time.monotonic() + timeout
            while not self.requests.try_write(records.STOP) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            try:
                await asyncio.wait_for(self.exited.wait(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.warning("worker %d did not stop in %.0f s; killing it", self.index, timeout)
                self.proc.kill()
                await self.exited.wait()
        self.close_rings()

    def close_rings(self) -> None:
        for ring, fds in ((self.requests, ("space_fd",)), (self.responses, ("data_fd",))):
            if ring is None:
                continue
            for attr in fds:
                self.loop.remove_reader(getattr(ring, attr))
            ring.close()
            ring.unlink()
        self.requests = self.responses = None

    def on_exit(self) -> None:
        self.loop.remove_reader(self.pidfd)
        os.close(self.pidfd)
        self.pidfd = -1
        code = self.proc.wait()
        was_ready = self.ready.is_set()
        self.ready.clear()
        if self.responses is not None:
            self.read_answers()  # answers the worker finished before it died still count
        self.exited.set()
        if self.stopping:
            log.info("worker %d exited (code %s)", self.index, code)
            return
        self.close_rings()
        self.restarts += 1
        metrics.WORKER_RESTARTS.inc()
        self.early_deaths = 0 if was_ready else self.early_deaths + 1
        log.error("worker %d died (code %s) with %d requests unanswered; restart #%d",
                  self.index, code, len(self.inflight), self.restarts)
        for req_id, p in list(self.inflight.items()):
            if p.drop_reason:  # its client left: nobody wants it any more
                self.drop(req_id, p.drop_reason)
                continue
            p.attempts += 1
            p.sent = False
            if p.attempts >= MAX_ATTEMPTS:
                self.fail(req_id, RequestError(grpc.StatusCode.INTERNAL,
                          f"the worker died {p.attempts} times while holding this request"))
        # Everything unanswered goes again, in the order it was first admitted.
        self.backlog = (deque(), deque())
        for req_id in sorted(self.inflight):
            self.backlog[self.inflight[req_id].priority].append(req_id)
        delay = 0.0 if was_ready else min(30.0, 0.5 * 2 ** self.early_deaths)
        self.loop.call_later(delay, self.respawn)

    def tick(self, generation: int) -> None:
        """The safety net for a lost wake-up (see shared_mem/ring.py): look again every few ms
        while work is outstanding. Nothing to do when idle, so an idle server stays quiet."""
        if generation != self.generation or self.responses is None:
            return  # this worker is gone; its successor runs its own tick
        if self.inflight:
            self.read_answers()
            self.expire_backlog()
            self.flush()
            # The worker's wake-up can be lost the same way; it sleeps in long slices and
            # relies on this nudge while it holds unread requests.
            if self.requests.free_bytes() < self.requests.capacity:
                self.requests.notify_consumer()
        self.loop.call_later(Ring.WAIT_SLICE if self.inflight else 0.05, self.tick, generation)

    def respawn(self) -> None:
        if self.stopping:
            return
        try:
            self.spawn()
        except Exception:
            log.exception("worker %d could not be restarted; trying again", self.index)
            self.loop.call_later(5.0, self.respawn)

    # ---- requests ----

    def submit(self, req_id: int, record: bytes, tokens: int, deadline_ns: int = 0,
               priority: int = 0) -> asyncio.Future:
        future = self.loop.create_future()
        self.inflight[req_id] = Pending(record, tokens, future, deadline_ns=deadline_ns, priority=priority)
        self.queued_tokens += tokens
        self.backlog[priority].append(req_id)
        self.flush()
        return future

    def cancel(self, req_id: int, reason: str) -> None:
        """The client left (or its deadline passed): drop the request if it has not reached the model."""
        pending = self.inflight.get(req_id)
        if pending is None or pending.drop_reason:
            return
        if not pending.sent:
            self.backlog[pending.priority].remove(req_id)
            self.drop(req_id, reason)
            return
        # In the ring or the worker: the worker answers CANCELLED if it had not batched it yet,
        # else the answer comes as usual and is thrown away (the future is already done).
        pending.drop_reason = reason
        if self.requests is not None:
            self.requests.try_write(records.CANCEL, records.encode_cancel(req_id))

    def drop(self, req_id: int, reason: str) -> None:
        metrics.DROPPED.labels(reason=reason).inc()
        self.fail(req_id, dropped_error(reason))

    def expire_backlog(self) -> None:
        """Drop backlogged requests whose deadline passed (the ring may be full for a while)."""
        now = time.monotonic_ns()
        for lane in self.backlog:
            expired = [r for r in lane if r in self.inflight and 0 < self.inflight[r].deadline_ns <= now]
            for req_id in expired:
                lane.remove(req_id)
                self.drop(req_id, "deadline")

    def flush(self) -> None:
        """Move backlogged requests into the ring while it has room: interactive ones first,
        FIFO within a lane; one whose deadline passed is dropped instead."""
        ring = self.requests
        if ring is None or not self.ready.is_set():
            return
        Ring.drain_signal(ring.space_fd)
        for first_try in (True, False):
            now = time.monotonic_ns()
            for lane in self.backlog:
                while lane:
                    pending = self.inflight.get(lane[0])
                    if pending is not None:
                        if 0 < pending.deadline_ns <= now:
                            self.drop(lane.popleft(), "deadline")
                            continue
                        if not ring.try_write(records.EMBED, pending.record):
                            break
                        pending.sent = True
                    lane.popleft()
                if lane:
                    break  # the ring is full; bulk must not pass interactive work
            if not any(self.backlog):
                ring.set_producer_sleeping(False)
                return
            if first_try:
                # Ask the worker to signal space_fd when it frees room, then try once more: it
                # may have freed some before it saw the flag.
                ring.set_producer_sleeping(True)

    def read_answers(self) -> None:
        ring = self.responses
        Ring.drain_signal(ring.data_fd)
        while True:
            ring.set_consumer_sleeping(False)
            while (item := ring.read()) is not None:
                kind, view = item
                if kind == records.RESULT:
                    self.answer(records.decode_result(view))
                elif kind == records.BATCH_RESULT:
                    report, results = records.decode_batch_result(view)  # bodies copied out
                    self.on_batch(report)
                    for result in results:
                        self.answer(result)
                elif kind == records.READY:
                    self.on_ready(json.loads(bytes(view)))
                del view
            ring.release()
            ring.set_consumer_sleeping(True)
            if not ring.has_data():  # checked after the flag, so no wake-up is lost
                return

    def on_ready(self, info: dict) -> None:
        self.info = info
        self.early_deaths = 0
        self.ready.set()
        log.info("worker %d ready: %s", self.index, info)
        self.flush()

    def on_batch(self, report: records.BatchReport) -> None:
        metrics.BATCH_TOKENS.observe(report.tokens)
        if self.batch_listener is not None:
            self.batch_listener(self.index, report)

    def answer(self, result: records.ResultRecord) -> None:
        pending = self.inflight.pop(result.req_id, None)
        if pending is None:
            return
        self.queued_tokens -= pending.tokens
        reason = _DROP_REASONS.get(result.status)
        if reason:  # the worker dropped it before the model; count it once, here
            metrics.DROPPED.labels(reason=pending.drop_reason or reason).inc()
        elif result.status == records.OK:
            metrics.QUEUE_SECONDS.observe(result.queue_us / 1e6)
            metrics.INFERENCE_SECONDS.observe(result.inference_us / 1e6)
        if not pending.future.done():
            pending.future.set_result(result)

    def fail(self, req_id: int, error: Exception) -> None:
        pending = self.inflight.pop(req_id)
        self.queued_tokens -= pending.tokens
        if not pending.future.done():
            pending.future.set_exception(error)


def core_share(index: int, workers: int) -> list[int]:
    """Worker `index`'s CPU cores: the frontend's allowed cores cut into `workers` even slices, so
    GPU feeders never fight over a core (a lone worker takes them all)."""
    cores = sorted(os.sched_getaffinity(0))
    if workers <= 1 or len(cores) < workers:
        return cores
    size = len(cores) // workers
    return cores[index * size:(index + 1) * size]


class WorkerPool:
    """All workers; routes each request to the one with the fewest queued tokens."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.handles = [WorkerHandle(i, cfg) for i in range(cfg.workers)]
        self.ids = itertools.count(1)
        self.max_record = Ring.max_record_for(cfg.request_ring_bytes)
        metrics.QUEUED_TOKENS.set_function(lambda: self.queued_tokens)

    def set_batch_listener(self, listener) -> None:
        for h in self.handles:
            h.batch_listener = listener

    @property
    def queued_tokens(self) -> int:
        return sum(h.queued_tokens for h in self.handles)

    @property
    def all_ready(self) -> bool:
        return all(h.ready.is_set() for h in self.handles)

    async def start(self, timeout: float = 300.0) -> None:
        await asyncio.gather(*(h.start(timeout) for h in self.handles))

    async def stop(self) -> None:
        await asyncio.gather(*(h.stop() for h in self.handles))

    async def embed(self, seqs, dims: int, normalize: bool, encoding: int, *, rows: records.RowPlan | None = None,
                    priority: int = 0, deadline_ns: int = 0) -> records.ResultRecord:
        tokens = sum(len(s) for s in seqs)
        if self.queued_tokens + tokens > self.cfg.max_queued_tokens:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the server holds {self.queued_tokens} queued tokens and this request adds "
                               f"{tokens}, over --max-queued-tokens {self.cfg.max_queued_tokens}; retry later")
        now = time.monotonic_ns()
        if deadline_ns and deadline_ns <= now:
            metrics.DROPPED.labels(reason="deadline").inc()
            raise dropped_error("deadline")
        handle = min(self.handles, key=lambda h: (not h.ready.is_set(), h.queued_tokens))
        req_id = next(self.ids)
        record = records.encode_request(req_id, now, seqs, dims, normalize, encoding, deadline_ns=deadline_ns,
                                        priority=priority, rows=rows)
        if len(record) > self.max_record:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the request holds {tokens} tokens in {len(seqs)} sequences, more than one "
                               f"request record can carry ({self.max_record} bytes); split it")
        try:
            return await handle.submit(req_id, record, tokens, deadline_ns, priority)
        except asyncio.CancelledError:
            # The client left (a unary call cancelled or past its gRPC deadline, a stream closed).
            # gRPC core's deadline timer can fire a little before our copy of the deadline (taken
            # from time_remaining() when the handler started), so a cancel this close counts as
            # the deadline's.
            late = deadline_ns and time.monotonic_ns() >= deadline_ns - DEADLINE_SLACK_NS
            handle.cancel(req_id, "deadline" if late else "cancelled")
            raise
