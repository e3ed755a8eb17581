"""Worker processes: start, watch, restart after a death, stop.

The supervisor owns each worker's process and its two rings; the requests belong to the
worker's `WorkerChannel` (server/channel.py). Starting a worker creates fresh rings, starts
`python -m pollen.worker` with their eventfds passed down, and attaches the rings to the
channel. A pidfd tells the supervisor when a worker exits: the channel detaches (reading what
the worker finished and queueing the rest again), the rings are removed, and a new worker starts
at once, or after a back-off (0.5 s doubling, at most 30 s) while workers die before READY.

Everything here runs on the event loop's thread.
"""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

from pollen.common.worker_config import WorkerConfig
from pollen.server import metrics
from pollen.server.channel import WorkerChannel
from pollen.server.config import ServeConfig
from pollen.shared_mem.ring import Ring

log = logging.getLogger("pollen.supervisor")

MAX_BACKOFF_S = 30.0


def core_share(index: int, workers: int) -> list[int]:
    """Worker `index`'s CPU cores: the frontend's allowed cores cut into `workers` even slices, so
    GPU feeders never fight over a core (a lone worker takes them all)."""
    cores = sorted(os.sched_getaffinity(0))
    if workers <= 1 or len(cores) < workers:
        return cores
    size = len(cores) // workers
    return cores[index * size:(index + 1) * size]


class WorkerProcess:
    """One running worker: its process, its pidfd and the rings it was started with."""

    def __init__(self, cfg: WorkerConfig, requests: Ring, responses: Ring, on_exit):
        self.requests, self.responses = requests, responses
        fds = [requests.data_fd, requests.space_fd, responses.data_fd, responses.space_fd]
        self.proc = subprocess.Popen([sys.executable, "-m", "pollen.worker", cfg.to_json()], pass_fds=fds)
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.exited = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.pidfd, self._on_exit, on_exit)

    def _on_exit(self, on_exit) -> None:
        self.loop.remove_reader(self.pidfd)
        os.close(self.pidfd)
        code = self.proc.wait()
        self.exited.set()
        on_exit(self, code)

    def remove_rings(self) -> None:
        for ring in (self.requests, self.responses):
            ring.close()
            ring.unlink()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


class Supervisor:
    def __init__(self, cfg: ServeConfig, channels: list[WorkerChannel]):
        self.cfg = cfg
        self.channels = channels
        self.loop = asyncio.get_running_loop()
        self.processes: list[WorkerProcess | None] = [None] * len(channels)
        self.early_deaths = [0] * len(channels)  # deaths before READY in a row, for the back-off
        self.restarts = 0
        self.stopping = False

    def worker_config(self, index: int, requests: Ring, responses: Ring) -> WorkerConfig:
        cfg = self.cfg
        return WorkerConfig(
            index=index, model=cfg.model, device=cfg.device, threads=cfg.worker_threads,
            max_batch_tokens=cfg.max_batch_tokens, bulk_batch_tokens=cfg.bulk_batch_tokens, parent_pid=os.getpid(),
            gpu=cfg.gpu_list()[index] if cfg.device == "cuda" else -1, cpu_cores=core_share(index, cfg.workers),
            dtype=cfg.worker_dtype(), cuda_graphs=cfg.cuda_graphs == "on", graph_max_tokens=cfg.graph_max_tokens,
            pooling=cfg.pooling, attention=cfg.attention, spin_us=cfg.worker_spin_us,
            request_ring=requests.name, request_fds=(requests.data_fd, requests.space_fd),
            response_ring=responses.name, response_fds=(responses.data_fd, responses.space_fd))

    def spawn(self, index: int) -> None:
        requests = Ring.create(self.cfg.request_ring_bytes)
        responses = Ring.create(self.cfg.response_ring_bytes)
        process = WorkerProcess(self.worker_config(index, requests, responses), requests, responses,
                                lambda p, code: self.on_exit(index, p, code))
        self.processes[index] = process
        self.channels[index].attach(requests, responses)
        log.info("worker %d started (pid %d)", index, process.proc.pid)

    async def start(self, timeout: float = 300.0) -> None:
        """Start every worker; return once all say READY (RuntimeError if one exits first)."""
        await asyncio.gather(*(self.start_one(i, timeout) for i in range(len(self.channels))))

    async def start_one(self, index: int, timeout: float) -> None:
        self.spawn(index)
        ready = asyncio.ensure_future(self.channels[index].ready.wait())
        died = asyncio.ensure_future(self.processes[index].exited.wait())
        done, _ = await asyncio.wait({ready, died}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        died.cancel()
        if not self.channels[index].ready.is_set():
            raise RuntimeError(f"worker {index} did not become ready "
                               f"({'it exited' if died in done else f'in {timeout} s'}); see its log above")

    def on_exit(self, index: int, process: WorkerProcess, code: int) -> None:
        channel = self.channels[index]
        was_ready = channel.ready.is_set()
        channel.detach(requeue=not self.stopping)
        if self.stopping:
            log.info("worker %d exited (code %s)", index, code)
            return
        process.remove_rings()
        self.restarts += 1
        metrics.WORKER_RESTARTS.inc()
        self.early_deaths[index] = 0 if was_ready else self.early_deaths[index] + 1
        log.error("worker %d died (code %s) with %d requests unanswered; restart #%d",
                  index, code, len(channel.inflight), self.restarts)
        delay = 0.0 if was_ready else min(MAX_BACKOFF_S, 0.5 * 2 ** self.early_deaths[index])
        self.loop.call_later(delay, self.respawn, index)

    def respawn(self, index: int) -> None:
        if self.stopping:
            return
        try:
            self.spawn(index)
        except Exception:
            log.exception("worker %d could not be restarted; trying again", index)
            self.loop.call_later(5.0, self.respawn, index)

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask every worker to finish what it holds and exit; kill those that do not."""
        self.stopping = True
        await asyncio.gather(*(self.stop_one(i, timeout) for i in range(len(self.channels))))

    async def stop_one(self, index: int, timeout: float) -> None:
        process = self.processes[index]
        if process is None:
            return
        if process.running:
            deadline = time.monotonic() + timeout
            while not self.channels[index].ask_to_stop() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            try:
                await asyncio.wait_for(process.exited.wait(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.warning("worker %d did not stop in %.0f s; killing it", index, timeout)
                process.proc.kill()
                await process.exited.wait()
        self.channels[index].detach(requeue=False)
        process.remove_rings()
