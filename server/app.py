"""The frontend process: check the model, start the workers, serve gRPC and HTTP until SIGTERM.

Shutdown order on SIGTERM or SIGINT: health says NOT_SERVING (gRPC and HTTP), both doors stop
taking new calls and wait (up to --shutdown-grace) for the calls in flight, then each worker
finishes what it holds and exits, and the shared-memory segments are removed.
"""
from __future__ import annotations

import asyncio
import logging
import platform
import resource
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pollen.common.model_spec import read_model_spec
from pollen.server.admission import Admission
from pollen.server.config import ServeConfig, open_files_limit
from pollen.server.http11 import HttpServer
from pollen.server.http_door import HttpDoor, error_response
from pollen.server.service import EmbedderService
from pollen.server.tokenizer import TextTokenizer
from pollen.server.workers import WorkerPool
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring, cleanup_stale_segments
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc

log = logging.getLogger("pollen")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Embedder"].full_name


def check_limits(cfg: ServeConfig, spec) -> None:
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


def raise_fd_limit() -> None:
    """Raise the soft open-files limit to the one --http-max-connections was checked against."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = open_files_limit()
    if soft < limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


async def serve(cfg: ServeConfig, stop: asyncio.Event | None = None, serving=None) -> None:
    """Serve until SIGTERM/SIGINT (or until `stop` is set, for in-process use such as tests);
    `serving(pool)` is called once the workers are ready."""
    check_platform()
    raise_fd_limit()
    removed = cleanup_stale_segments()
    if removed:
        log.info("removed %d shared-memory segments left by a dead server", len(removed))
    spec = read_model_spec(cfg.model, pooling=cfg.pooling, attention=cfg.attention)
    check_limits(cfg, spec)
    executor = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="pollen-tokenize")
    admission = Admission(spec, TextTokenizer(cfg.model, spec.max_tokens), executor, cfg.max_texts_per_request)
    pool = WorkerPool(cfg)

    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", cfg.max_request_bytes),
        ("grpc.max_send_message_length", -1),
        # gRPC core sheds calls that wait for the handler past a soft limit of 1,000 with a bare
        # CANCELLED. Admission is ours to decide (--max-queued-tokens answers RESOURCE_EXHAUSTED
        # with a reason), so let the core hold many more.
        ("grpc.server.max_pending_requests", 1 << 16),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 17),
    ])
    service = EmbedderService(cfg, spec, admission, pool)
    pb_grpc.add_EmbedderServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if server.add_insecure_port(cfg.listen) == 0 and not cfg.listen.startswith("unix:"):
        raise OSError(f"cannot listen on {cfg.listen}")

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    await server.start()
    door, http = None, None
    try:
        if cfg.http_listen:
            door = HttpDoor(service)
            http = HttpServer(door.handle, error_response, max_body_bytes=cfg.max_request_bytes,
                              max_connections=cfg.http_max_connections, write_timeout=cfg.http_write_timeout)
            host, _, port = cfg.http_listen.rpartition(":")
            await http.start(host, int(port))
        log.info("loading %s on %d %s worker(s)", spec.name, cfg.workers, cfg.device)
        starting = asyncio.ensure_future(pool.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # raises if a worker could not start
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            if door:
                door.serving = True
            log.info("serving %s on %s (gRPC)%s", spec.name, cfg.listen,
                     f" and {cfg.http_listen} (HTTP)" if http else "")
            if serving is not None:
                serving(pool)
            await stop.wait()
        else:
            starting.cancel()
        log.info("stopping: finishing the work in flight (up to %.0f s)", cfg.shutdown_grace)
        await health_servicer.enter_graceful_shutdown()
        if door:
            door.serving = False
        await asyncio.gather(server.stop(cfg.shutdown_grace),
                             http.stop(cfg.shutdown_grace) if http else asyncio.sleep(0))
    finally:
        if http:
            await http.stop(0)
        await pool.stop()
        executor.shutdown(wait=False, cancel_futures=True)
        log.info("stopped")
