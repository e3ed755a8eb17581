"""`pollen serve` itself: the supervisor of the frontend and worker processes.

The supervisor holds no client connection and runs no model. It claims the listening addresses
(server/process/address.py), creates the server state (shared_mem/server_state.py) and one ring pair per
(frontend, worker), starts --frontends frontend processes (server/process/frontend.py) and one worker per
device (worker/), hands each side its rings over the control sockets (common/control.py), and then
watches: a child that dies is started again; a worker whose heartbeat stops for
--worker-hang-timeout is killed first. When a worker dies every frontend is told (worker_down):
it reads what the worker finished and sends the rest again to the next worker; when a frontend
dies every worker forgets its requests (drop_link) — its clients' connections died with it.

Restarts: a worker dead before READY waits 0.5 s doubling (at most MAX_BACKOFF_S) before the next
try; one that was serving is restarted at once; a frontend after FRONTEND_RESTART_S. SIGTERM or
SIGINT: every frontend drains and answers what it received (server/process/frontend.py), then each worker
is told to finish what it holds and exit, and the shared memory is removed. Everything here runs
on one asyncio loop; children are watched through pidfds.

A child's rings are made before the child is started, so a restart that /dev/shm cannot hold
(another program filled it) starts nothing, says so in one line and is tried again, 0.5 s doubling
up to MAX_BACKOFF_S.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from pollen.common import control
from pollen.common.model_spec import check_tokenizer
from pollen.common.worker_config import WorkerConfig
from pollen.server import auth
from pollen.server.config import FrontendConfig, ServeConfig, worker_environment
from pollen.server.grpc_api.grpc_core import GRPC_CORE_ENV
from pollen.server.observe import metrics
from pollen.server.process.address import Claim, claim
from pollen.shared_mem.ring import Ring
from pollen.shared_mem.ring_pair import RingPair
from pollen.shared_mem.segment import NoSpace
from pollen.shared_mem.server_state import ServerState

log = logging.getLogger("pollen.supervisor")

# A frontend's environment, unless the user's sets the same variable: gRPC core's settings, the
# tokenizers library on the calling thread, not on a pool of its own that competes with the frontends,
# and malloc thresholds. An answer of token vectors is megabytes (a message of 16 texts of BGE-M3's
# ColBERT vectors: 12 MiB), copied out of the ring, into the protobuf message and into its serialized
# bytes; glibc maps each such block anew and trims its heap top past twice its automatic threshold,
# so every copy faulted its pages in again. With both thresholds at FRONTEND_HEAP_KEEP the heap keeps
# such blocks for reuse, holding at most that much free memory above its top; a larger block is
# still mapped.
FRONTEND_HEAP_KEEP = 64 << 20
FRONTEND_ENV = {"TOKENIZERS_PARALLELISM": "false", "MALLOC_MMAP_THRESHOLD_": str(FRONTEND_HEAP_KEEP),
                "MALLOC_TRIM_THRESHOLD_": str(FRONTEND_HEAP_KEEP), **GRPC_CORE_ENV}

MAX_BACKOFF_S = 30.0
FRONTEND_RESTART_S = 0.5
HANG_CHECK_S = 0.5
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0


def core_share(index: int, workers: int) -> list[int]:
    """Worker `index`'s CPU cores on the CPU: the allowed cores cut into `workers` even slices (a
    lone worker takes them all)."""
    cores = sorted(os.sched_getaffinity(0))
    if workers <= 1 or len(cores) < workers:
        return cores
    size = len(cores) // workers
    return cores[index * size:(index + 1) * size]


def worker_cores(cfg: ServeConfig, index: int, cores: list[int] | None = None) -> list[int]:
    """A GPU worker's two cores (its loop and the driver's threads), taken from the end of the
    allowed cores so the frontends keep the rest; CPU workers share every core (core_share)."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if cfg.device != "cuda" or len(cores) < 2 * cfg.workers + 1:
        return core_share(index, cfg.workers)
    return cores[len(cores) - 2 * (index + 1):len(cores) - 2 * index]


def frontend_cores(cfg: ServeConfig, cores: list[int] | None = None) -> list[int]:
    """The frontends' cores: with GPU workers on cores of their own, the allowed cores without
    them (a GPU worker polls its rings on its core; a frontend the scheduler puts beside it would
    slow both), else [] (as inherited: CPU workers share every core)."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if cfg.device != "cuda" or len(cores) < 2 * cfg.workers + 1:
        return []
    taken = {c for w in range(cfg.workers) for c in worker_cores(cfg, w, cores)}
    return [c for c in cores if c not in taken]


class Child:
    """A frontend or worker process: its control socket and its pidfd."""

    def __init__(self, name: str, argv: list[str], theirs: socket.socket, ours: socket.socket, on_exit,
                 env: dict[str, str] | None = None):
        self.name = name
        self.control = ours
        self.error: str | None = None  # what its last "failed" message said, read when it exits
        self.proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], env=env)
        theirs.close()  # the child has its copy
        self.pid = self.proc.pid
        self.pidfd = os.pidfd_open(self.pid)
        self.exited = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.pidfd, self._on_exit, on_exit)

    def _on_exit(self, on_exit) -> None:
        self.loop.remove_reader(self.pidfd)
        os.close(self.pidfd)
        code = self.proc.wait()
        self.exited.set()
        self.loop.remove_reader(self.control.fileno())
        self.error = self._failure() or self.error
        self.control.close()
        on_exit(self, code)

    def _failure(self) -> str | None:
        """The error of a "failed" message the child sent before it exited and nobody read yet.
        A child that leaves our messages unread resets the socket as it exits: the first read
        says so, and its own messages follow."""
        error = None
        for _ in range(2):
            try:
                while (message := control.receive(self.control)) is not None:
                    body, fds = message
                    control.close_fds(fds)
                    if body.get("kind") == "failed":
                        error = body.get("error")
                break
            except ConnectionResetError:
                continue
            except (EOFError, OSError, ValueError):
                break
        return error

    @property
    def alive(self) -> bool:
        return not self.exited.is_set()

    def send(self, message: dict, fds: tuple[int, ...] = ()) -> None:
        if self.alive:
            try:
                control.send(self.control, message, fds)
            except OSError:
                pass  # it is dying; its pidfd will say so

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive:
            self.proc.send_signal(sig)


class Supervisor:
    def __init__(self, cfg: ServeConfig, metrics_dir: str | None = None):
        self.cfg = cfg
        self.metrics_dir = metrics_dir
        self.state = ServerState.create(cfg.frontends, cfg.workers)
        self.claims: list[Claim] = []
        self.workers: list[Child | None] = [None] * cfg.workers
        self.frontends: list[Child | None] = [None] * cfg.frontends
        self.pairs: dict[tuple[int, int], RingPair] = {}  # (frontend, worker) -> their rings
        self.listening: set[int] = set()
        self.failure: str | None = None  # why the start failed
        self.started = False
        self.early_deaths = [0] * cfg.workers  # deaths before READY in a row, for the back-off
        self.restarts = 0
        self.stopping = False
        self.loop = asyncio.get_running_loop()
        self.listen = self.http_listen = ""

    # ---- start ----

    async def start(self) -> None:
        """Claim the addresses, start every child; return once all listen and every worker is ready."""
        for path in self.cfg.model_paths():  # the frontends load them: a bad one is refused before any starts
            check_tokenizer(path)
        grpc_claim = claim(self.cfg.listen, "gRPC")
        self.claims.append(grpc_claim)
        self.listen = grpc_claim.address
        if self.cfg.http_listen:
            http_claim = claim(self.cfg.http_listen, "HTTP")
            self.claims.append(http_claim)
            self.http_listen = http_claim.address
        for w in range(self.cfg.workers):
            self.spawn_worker(w)
        for f in range(self.cfg.frontends):
            self.spawn_frontend(f)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.failure and not self.all_up():
            if time.monotonic() > deadline:
                self.failure = f"the server did not start in {START_TIMEOUT_S:.0f} s"
            await asyncio.sleep(0.02)
        if self.failure:
            raise RuntimeError(self.failure)
        self.started = True
        # Only now may health say SERVING: until here a child's death aborts the start.
        for frontend in self.frontends:
            if frontend is not None:
                frontend.send({"kind": "started"})
        self.loop.call_later(HANG_CHECK_S, self.check_hangs)

    def all_up(self) -> bool:
        return (len(self.listening) == self.cfg.frontends
                and all(self.state.ready(w) for w in range(self.cfg.workers)))

    # ---- children ----

    def spawn_worker(self, w: int) -> None:
        frontends = [f for f, frontend in enumerate(self.frontends) if frontend is not None and frontend.alive]
        rings = self.new_rings(len(frontends))
        ours, theirs = control.pair()
        wcfg = WorkerConfig.of(self.cfg, w, control_fd=theirs.fileno(), state=self.state.name,
                               cpu_cores=worker_cores(self.cfg, w))
        argv = [sys.executable, "-m", "pollen.worker", wcfg.to_json()]
        self.workers[w] = child = Child(f"worker {w}", argv, theirs, ours,
                                        lambda c, code: self.on_worker_exit(w, code, c.error),
                                        env=worker_environment(self.cfg.device, auth.without_keys(os.environ)))
        log.info("worker %d started (pid %d)", w, child.pid)
        for f, pair in zip(frontends, rings):
            self.connect(f, w, pair)

    def spawn_frontend(self, f: int) -> None:
        workers = [w for w, worker in enumerate(self.workers) if worker is not None and worker.alive]
        rings = self.new_rings(len(workers))
        ours, theirs = control.pair()
        fcfg = FrontendConfig.of(self.cfg, f, listen=self.listen, http_listen=self.http_listen,
                                 control_fd=theirs.fileno(), state=self.state.name, cpu_cores=frontend_cores(self.cfg))
        argv = [sys.executable, "-m", "pollen.server.process.frontend", fcfg.to_json()]
        self.frontends[f] = child = Child(f"frontend {f}", argv, theirs, ours,
                                          lambda c, code: self.on_frontend_exit(f, c, code),
                                          env={**FRONTEND_ENV, **os.environ})
        self.loop.add_reader(child.control.fileno(), self.on_frontend_message, f, child)
        if self.started:  # a frontend restarted after the start
            child.send({"kind": "started"})
        for w, pair in zip(workers, rings):
            self.connect(f, w, pair)

    def new_rings(self, count: int) -> list[tuple[Ring, Ring]]:
        """`count` fresh (request ring, response ring) pairs, or NoSpace and none."""
        made: list[Ring] = []
        try:
            for _ in range(count):
                made.append(Ring.create(self.cfg.request_ring_bytes))
                made.append(Ring.create(self.cfg.response_ring_bytes))
        except BaseException:
            for ring in made:
                ring.unlink()
                ring.close()
            raise
        return list(zip(made[::2], made[1::2]))

    def connect(self, f: int, w: int, rings: tuple[Ring, Ring]) -> None:
        """Hand a fresh ring pair to frontend f and worker w."""
        self.pairs[f, w] = pair = RingPair.of(*rings)
        self.workers[w].send({"kind": "add_link", "frontend": f, **pair.names()}, pair.fds)
        self.frontends[f].send({"kind": "worker_up", "worker": w, **pair.names()}, pair.fds)
        for ring in rings:
            ring.close()  # both peers hold their own fds and mappings now

    def disconnect(self, f: int, w: int) -> None:
        pair = self.pairs.pop((f, w), None)
        if pair is not None:
            pair.unlink()

    def on_frontend_message(self, f: int, child: Child) -> None:
        try:
            while (message := control.receive(child.control)) is not None:
                body, fds = message
                control.close_fds(fds)
                if body["kind"] == "listening":
                    self.listening.add(f)
                elif body["kind"] == "failed" and not self.started:
                    self.failure = f"frontend {f} could not start: {body.get('error')}"
        except (EOFError, OSError):
            self.loop.remove_reader(child.control.fileno())

    def on_worker_exit(self, w: int, code: int, error: str | None = None) -> None:
        was_ready = self.state.ready(w)
        self.state.clear_worker(w)
        for f, frontend in enumerate(self.frontends):
            if frontend is not None:
                frontend.send({"kind": "worker_down", "worker": w})
            self.disconnect(f, w)
        if self.stopping:
            log.info("worker %d exited (code %s)", w, code)
            return
        if not self.started:
            self.failure = (f"worker {w} could not load the model: {error}" if error else
                            f"worker {w} exited (code {code}) before it was ready; see its log above")
            return
        self.restarts += 1
        metrics.WORKER_RESTARTS.inc()
        self.early_deaths[w] = 0 if was_ready else self.early_deaths[w] + 1
        log.error("worker %d died (code %s)%s; restart #%d", w, code, f": {error}" if error else "", self.restarts)
        delay = 0.0 if was_ready else min(MAX_BACKOFF_S, 0.5 * 2 ** self.early_deaths[w])
        self.loop.call_later(delay, self.respawn, self.spawn_worker, w, "worker")

    def on_frontend_exit(self, f: int, child: Child, code: int) -> None:
        self.listening.discard(f)
        if metrics.MULTIPROCESS:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(child.pid)
        self.state.clear_frontend(f)
        for w, worker in enumerate(self.workers):
            if worker is not None:
                worker.send({"kind": "drop_link", "frontend": f})
            self.disconnect(f, w)
        if self.stopping:
            return
        if not self.started:
            self.failure = self.failure or (f"frontend {f} could not start: {child.error}" if child.error else
                                            f"frontend {f} exited (code {code}) before it listened")
            return
        log.error("frontend %d died (code %s); restarting it", f, code)
        self.loop.call_later(FRONTEND_RESTART_S, self.respawn, self.spawn_frontend, f, "frontend")

    def respawn(self, spawn, index: int, what: str, wait: float = 0.5) -> None:
        if self.stopping:
            return
        try:
            spawn(index)
        except NoSpace as exc:
            log.error("%s %d cannot be restarted: %s; trying again in %.1f s", what, index, exc, wait)
            self.loop.call_later(wait, self.respawn, spawn, index, what, min(MAX_BACKOFF_S, 2 * wait))
        except Exception:
            log.exception("could not restart %s %d; trying again", what, index)
            self.loop.call_later(5.0, self.respawn, spawn, index, what)

    def check_hangs(self) -> None:
        """Kill a ready worker whose heartbeat is older than --worker-hang-timeout; its death
        restarts it and its requests go again."""
        if self.stopping:
            return
        now = time.monotonic_ns()
        for w, worker in enumerate(self.workers):
            beat = self.state.heartbeat_ns(w)
            if worker is not None and worker.alive and self.state.ready(w) and beat:
                stalled = (now - beat) / 1e9
                if stalled > self.cfg.worker_hang_timeout:
                    log.error("worker %d made no progress for %.1f s (--worker-hang-timeout %.0f s); killing it",
                              w, stalled, self.cfg.worker_hang_timeout)
                    worker.kill()
        self.loop.call_later(HANG_CHECK_S, self.check_hangs)

    # ---- stop ----

    async def stop(self) -> None:
        """Frontends drain and exit, then workers finish and exit; the shared memory goes."""
        self.stopping = True
        frontends = [c for c in self.frontends if c is not None and c.alive]
        for child in frontends:
            child.kill(signal.SIGTERM)
        await self.wait_or_kill(frontends, self.cfg.shutdown_grace + STOP_TIMEOUT_S)
        workers = [c for c in self.workers if c is not None and c.alive]
        for child in workers:
            child.send({"kind": "stop"})
        await self.wait_or_kill(workers, STOP_TIMEOUT_S)
        for f, w in list(self.pairs):
            self.disconnect(f, w)
        self.state.close()
        self.state.unlink()
        for c in self.claims:
            c.release()
        if self.metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    async def wait_or_kill(self, children: list[Child], timeout: float) -> None:
        if not children:
            return
        waits = [asyncio.ensure_future(c.exited.wait()) for c in children]
        _, late = await asyncio.wait(waits, timeout=timeout)
        for child in children:
            if child.alive:
                log.warning("%s did not stop in %.0f s; killing it", child.name, timeout)
                child.kill()
        for child in children:
            await child.exited.wait()
