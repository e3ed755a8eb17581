"""The frontend process: build everything, start the workers, serve gRPC and HTTP, shut down.

Three steps, each its own method: `Frontend.build` checks the model and the settings and wires
the parts together (nothing listens yet); `run` opens both doors, starts the workers, says
SERVING once they are ready and waits for SIGTERM/SIGINT (or `stop`); `shutdown` stops in this
order: health says NOT_SERVING (gRPC and HTTP), both doors stop taking new calls and wait (up to
--shutdown-grace) for the calls in flight, then each worker finishes what it holds and exits,
and the shared-memory segments are removed.
"""
from __future__ import annotations

import asyncio
import logging
import platform
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pollen.common.model_spec import ModelSpec, read_model_spec
from pollen.server.admission import Admission
from pollen.server.channel import WorkerChannel
from pollen.server.config import ServeConfig
from pollen.server.http11 import HttpServer
from pollen.server.http_door import HttpDoor, error_response
from pollen.server.router import Router
from pollen.server.service import EmbedderService, add_to_server
from pollen.server.supervisor import Supervisor
from pollen.server.tokenizer import TextTokenizer
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring, cleanup_stale_segments
from pollen.v1 import embedder_pb2 as pb

log = logging.getLogger("pollen")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Embedder"].full_name
SERVICES = ("", SERVICE_NAME)  # the names the health service answers for


def check_limits(cfg: ServeConfig, spec: ModelSpec) -> None:
    """Refuse at start the settings that would fail requests later."""
    if cfg.max_batch_tokens < spec.max_tokens:
        raise ValueError(f"--max-batch-tokens {cfg.max_batch_tokens} is below the model's limit of "
                         f"{spec.max_tokens} tokens: one long text could never be batched")
    # A batch's answer record must fit the response ring; the worker caps the rows of a batch for
    # it (records.max_batch_rows), and one sequence can cost a request's outputs and a row more
    # (the chunks of a document, or the last text of a request begun in an earlier batch).
    batch_rows = records.max_batch_rows(Ring.max_record_for(cfg.response_ring_bytes), spec.hidden_size)
    if batch_rows < cfg.max_texts_per_request + 1:
        raise ValueError(f"--response-ring-bytes {cfg.response_ring_bytes} is too small for answers of up to "
                         f"{cfg.max_texts_per_request} x {spec.hidden_size} float32 values (one batch record "
                         f"would hold only {batch_rows} rows)")
    largest_request = records.REQUEST_HEADER + cfg.max_texts_per_request * 4 * (1 + spec.max_tokens)
    if largest_request > Ring.max_record_for(cfg.request_ring_bytes):
        raise ValueError(f"--request-ring-bytes {cfg.request_ring_bytes} cannot hold one request of "
                         f"{cfg.max_texts_per_request} texts of {spec.max_tokens} tokens")


def check_platform() -> None:
    """The rings rely on x86-64 memory ordering (shared_mem/ring.py says why); refuse elsewhere
    rather than risk reading a record before its bytes land."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"pollen's shared-memory rings need x86-64 memory ordering; this machine is "
                           f"{platform.machine()!r}, where they would need fences Python cannot issue")


def grpc_server(cfg: ServeConfig, service: EmbedderService) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", cfg.max_request_bytes),
        ("grpc.max_send_message_length", -1),
        # gRPC core sheds calls that wait for the handler past a soft limit of 1,000 with a bare
        # CANCELLED. Admission is ours to decide (--max-queued-tokens answers RESOURCE_EXHAUSTED
        # with a reason), so let the core hold many more.
        ("grpc.server.max_pending_requests", 1 << 16),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 17),
    ])
    add_to_server(service, server)  # lenient deserializers: bad bytes get INVALID_ARGUMENT
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if server.add_insecure_port(cfg.listen) == 0 and not cfg.listen.startswith("unix:"):
        raise OSError(f"cannot listen on {cfg.listen}")
    return server, health_servicer


class Frontend:
    def __init__(self, cfg: ServeConfig, spec: ModelSpec, executor: ThreadPoolExecutor, router: Router,
                 supervisor: Supervisor, service: EmbedderService):
        self.cfg, self.spec, self.executor = cfg, spec, executor
        self.router, self.supervisor, self.service = router, supervisor, service
        self.grpc, self.health = grpc_server(cfg, service)
        self.door = HttpDoor(service) if cfg.http_listen else None
        self.http = (HttpServer(self.door.handle, error_response, max_body_bytes=cfg.max_request_bytes)
                     if self.door else None)

    @classmethod
    def build(cls, cfg: ServeConfig) -> Frontend:
        """Check the platform, the model and the limits; wire the parts (nothing starts here)."""
        check_platform()
        removed = cleanup_stale_segments()
        if removed:
            log.info("removed %d shared-memory segments left by a dead server", len(removed))
        spec = read_model_spec(cfg.model, pooling=cfg.pooling, attention=cfg.attention)
        check_limits(cfg, spec)
        executor = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="pollen-tokenize")
        admission = Admission(spec, TextTokenizer(cfg.model, spec.max_tokens), executor, cfg.max_texts_per_request)
        channels = [WorkerChannel(i) for i in range(cfg.workers)]
        router = Router(cfg, channels)
        return cls(cfg, spec, executor, router, Supervisor(cfg, channels),
                   EmbedderService(cfg, spec, admission, router))

    async def run(self, stop: asyncio.Event, serving=None) -> None:
        """Serve until `stop` is set; `serving(router)` is called once the workers are ready."""
        await self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        if self.http:
            host, _, port = self.cfg.http_listen.rpartition(":")
            await self.http.start(host, int(port))
        log.info("loading %s on %d %s worker(s)", self.spec.name, self.cfg.workers, self.cfg.device)
        starting = asyncio.ensure_future(self.supervisor.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return
        starting.result()  # raises if a worker could not start
        await self.set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s (gRPC)%s", self.spec.name, self.cfg.listen,
                 f" and {self.cfg.http_listen} (HTTP)" if self.http else "")
        if serving is not None:
            serving(self.router)
        await stop.wait()

    async def set_health(self, status) -> None:
        for name in SERVICES:
            await self.health.set(name, status)
        if self.door:
            self.door.serving = status == health_pb2.HealthCheckResponse.SERVING

    async def shutdown(self) -> None:
        """Finish the calls in flight (up to --shutdown-grace), then stop the workers."""
        log.info("stopping: finishing the work in flight (up to %.0f s)", self.cfg.shutdown_grace)
        try:
            await self.health.enter_graceful_shutdown()
            if self.door:
                self.door.serving = False
            await asyncio.gather(self.grpc.stop(self.cfg.shutdown_grace),
                                 self.http.stop(self.cfg.shutdown_grace) if self.http else asyncio.sleep(0))
        finally:
            if self.http:
                await self.http.stop(0)
            await self.supervisor.stop()
            self.executor.shutdown(wait=False, cancel_futures=True)
            log.info("stopped")


async def serve(cfg: ServeConfig, stop: asyncio.Event | None = None, serving=None) -> None:
    """Serve until SIGTERM/SIGINT (or until `stop` is set, for in-process use such as tests);
    `serving(router)` is called once the workers are ready."""
    frontend = Frontend.build(cfg)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        await frontend.run(stop, serving)
    finally:
        await frontend.shutdown()
