"""Worker processes as the frontend sees them: start, feed, read answers, restart, stop.

Each WorkerHandle owns one worker process and its two rings, and keeps every request it sent
until the answer arrives. When the process dies, the handle starts a new one on fresh rings and
sends the unanswered requests again, in their original order: the client sees no error. A
request that was in flight in three crashes in a row is answered INTERNAL instead, so one
poisonous input cannot crash-loop a worker forever.

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

from server.config import ServeConfig
from server.errors import RequestError
from shared_mem import records
from shared_mem.ring import Ring
from worker.main import WorkerConfig

log = logging.getLogger("pollen.workers")

MAX_ATTEMPTS = 3


@dataclass(slots=True)
class Pending:
    record: bytes  # the request record, kept for a resend
    tokens: int
    future: asyncio.Future
    attempts: int = 0


class WorkerHandle:
    def __init__(self, index: int, cfg: ServeConfig):
        self.index = index
        self.cfg = cfg
        self.loop = asyncio.get_running_loop()
        self.inflight: dict[int, Pending] = {}
        self.backlog: deque[int] = deque()  # request ids admitted but not yet in the ring
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

    # ---- life cycle ----

    def spawn(self) -> None:
        cfg = self.cfg
        self.requests = Ring.create(cfg.request_ring_bytes)
        self.responses = Ring.create(cfg.response_ring_bytes)
        gpu = cfg.gpu_list()[self.index] if cfg.device == "cuda" else -1
        wcfg = WorkerConfig(
            index=self.index, model=cfg.model, device=cfg.device, threads=cfg.worker_threads,
            max_batch_tokens=cfg.max_batch_tokens, parent_pid=os.getpid(),
            gpu=gpu, cpu_cores=core_share(self.index, cfg.workers), dtype=cfg.worker_dtype(),
            cuda_graphs=cfg.cuda_graphs == "on", graph_max_tokens=cfg.graph_max_tokens,
            pooling=cfg.pooling, attention=cfg.attention,
            request_ring=self.requests.name, request_fds=(self.requests.data_fd, self.requests.space_fd),
            response_ring=self.responses.name, response_fds=(self.responses.data_fd, self.responses.space_fd))
        fds = [*wcfg.request_fds, *wcfg.response_fds]
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.main", wcfg.to_json()], pass_fds=fds)
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
        self.early_deaths = 0 if was_ready else self.early_deaths + 1
        log.error("worker %d died (code %s) with %d requests unanswered; restart #%d",
                  self.index, code, len(self.inflight), self.restarts)
        for req_id, p in list(self.inflight.items()):
            p.attempts += 1
            if p.attempts >= MAX_ATTEMPTS:
                self.fail(req_id, RequestError(grpc.StatusCode.INTERNAL,
                          f"the worker died {p.attempts} times while holding this request"))
        # Everything unanswered goes again, in the order it was first admitted.
        self.backlog = deque(sorted(self.inflight))
        delay = 0.0 if was_ready else min(30.0, 0.5 * 2 ** self.early_deaths)
        self.loop.call_later(delay, self.respawn)

    def tick(self, generation: int) -> None:
        """The safety net for a lost wake-up (see shared_mem/ring.py): look again every few ms
        while work is outstanding. Nothing to do when idle, so an idle server stays quiet."""
        if generation != self.generation or self.responses is None:
            return  # this worker is gone; its successor runs its own tick
        if self.inflight:
            self.read_answers()
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

    def submit(self, req_id: int, record: bytes, tokens: int) -> asyncio.Future:
        future = self.loop.create_future()
        self.inflight[req_id] = Pending(record, tokens, future)
        self.queued_tokens += tokens
        self.backlog.append(req_id)
        self.flush()
        return future

    def flush(self) -> None:
        """Move backlogged requests into the ring while it has room (FIFO, nothing overtakes)."""
        ring = self.requests
        if ring is None or not self.ready.is_set():
            return
        Ring.drain_signal(ring.space_fd)
        for first_try in (True, False):
            while self.backlog:
                pending = self.inflight.get(self.backlog[0])
                if pending is not None and not ring.try_write(records.EMBED, pending.record):
                    break
                self.backlog.popleft()
            if not self.backlog:
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

    def answer(self, result: records.ResultRecord) -> None:
        pending = self.inflight.pop(result.req_id, None)
        if pending is None:
            return
        self.queued_tokens -= pending.tokens
        if not pending.future.done():
            pending.future.set_result(result)

    def fail(self, req_id: int, error: Exception) -> None:
        pending = self.inflight.pop(req_id)
        self.queued_tokens -= pending.tokens
        if not pending.future.done():
            pending.future.set_exception(error)


def core_share(index: int, workers: int) -> list[int]:
    """Worker `index`'s CPU cores: the frontend's allowed cores cut into `workers` even slices, so
    GPU feeders never fight over a core (on the CPU, one worker takes them all)."""
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

    async def embed(self, seqs, dims: int, normalize: bool, encoding: int) -> records.ResultRecord:
        tokens = sum(len(s) for s in seqs)
        if self.queued_tokens + tokens > self.cfg.max_queued_tokens:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the server holds {self.queued_tokens} queued tokens and this request adds "
                               f"{tokens}, over --max-queued-tokens {self.cfg.max_queued_tokens}; retry later")
        handle = min(self.handles, key=lambda h: (not h.ready.is_set(), h.queued_tokens))
        req_id = next(self.ids)
        record = records.encode_request(req_id, time.monotonic_ns(), seqs, dims, normalize, encoding)
        return await handle.submit(req_id, record, tokens)
