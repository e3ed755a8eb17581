"""A frontend process: `python -m pollen.server.process.frontend '<FrontendConfig as JSON>'`.

The supervisor (server/process/supervisor.py) starts --frontends of these. Each serves gRPC and HTTP on
the shared addresses (the kernel spreads connections over them: SO_REUSEPORT), tokenizes and
admits requests, and sends them to the workers over one ring pair with each, whose frontend end
is a WorkerChannel (server/pipeline/channel.py). The control socket (common/control.py) brings each
worker's ring pair (worker_up) and takes it away when the worker dies (worker_down).

Three steps: `build` wires the parts (nothing listens yet); `run` opens both doors, says
`listening` to the supervisor and SERVING on health once the supervisor says the server has
started (every frontend listening, every worker ready), and waits for SIGTERM; `shutdown`
drains: health says NOT_SERVING, streams stop reading, every call received is answered (never
CANCELLED), then both doors stop taking calls and wait (up to --shutdown-grace) for those in
flight; new calls are refused UNAVAILABLE by gRPC itself.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pollen.common import control
from pollen.common.process import bootstrap, config_from_argv
from pollen.server.config import FrontendConfig, ServeConfig
from pollen.server.core import Core
from pollen.server.grpc_api.flood_guard import FloodGuard
from pollen.server.grpc_api.service import GRPC_LIMIT_FACTOR, EmbedderService, add_to_server
from pollen.server.grpc_api.tei import SERVICE_NAMES as TEI_SERVICES
from pollen.server.grpc_api.tei import add_to_server as add_tei_to_server
from pollen.server.grpc_api.tei import serving_names
from pollen.server.http_api.door import HttpDoor, error_response
from pollen.server.http_api.http11 import HttpServer
from pollen.server.model_table import ModelTable
from pollen.server.observe import metrics, tracing
from pollen.server.pipeline.channel import WorkerChannel
from pollen.server.pipeline.router import Router
from pollen.server.process.served_model import served_specs
from pollen.shared_mem.ring_pair import RingPair
from pollen.shared_mem.server_state import ServerState
from pollen.v1 import embedder_pb2 as pb

log = logging.getLogger("pollen.frontend")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Embedder"].full_name
SERVICES = ("", SERVICE_NAME)  # the names the health service answers for (and TEI's: `health_names`)
QUIET_S = 0.2  # a draining frontend stops gRPC once no call has arrived for this long
HOLD_S = 1.0   # or after this long at most (half the grace where that is shorter)


def grpc_options(cfg: ServeConfig) -> list[tuple]:
    """The frontend's grpc.aio server options."""
    return [
        # Up to GRPC_LIMIT_FACTOR x --max-request-bytes: messages over the flag are refused by the
        # service one by one (server/grpc_api/service.py Oversize); gRPC would end a whole stream.
        ("grpc.max_receive_message_length", min(GRPC_LIMIT_FACTOR * cfg.max_request_bytes, (1 << 31) - 1)),
        ("grpc.max_send_message_length", -1),
        # A connection's streams, counted until gRPC has torn each down (its overload protection):
        # a client that opens and resets streams as fast as it can (the HTTP/2 rapid reset) gets
        # REFUSED_STREAM past the bound. The streams it reset that gRPC took are calls gRPC holds,
        # in line with every other client's new calls, until the event loop takes them one by one:
        # the bound is what one connection parks ahead of other clients' calls, a small share of
        # the pending bound below.
        ("grpc.max_concurrent_streams", cfg.grpc_max_streams_per_connection),
        # Calls gRPC core has taken but the event loop not yet asked for. Past the bound the core
        # ends a new one with a bare CANCELLED; admission refuses work with a reason long before
        # (--max-queued-tokens), so this only bounds what a flood over many connections can park.
        ("grpc.server.max_pending_requests", cfg.grpc_max_pending_calls),
        ("grpc.server.max_pending_requests_hard_limit", cfg.grpc_max_pending_calls),
        # Channelz keeps per-call statistics for its debug service, which pollen does not serve.
        ("grpc.enable_channelz", 0),
    ]


def grpc_server(cfg: ServeConfig, service: EmbedderService, listen: str):
    server = grpc.aio.server(options=grpc_options(cfg))
    add_to_server(service, server)  # deserializers that never raise: bad bytes get INVALID_ARGUMENT
    add_tei_to_server(service, server)  # TEI's tei.v1 beside it (server/grpc_api/tei.py)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, *TEI_SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                        server)
    if listen and server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    return server, health_servicer


def health_names(service: EmbedderService) -> tuple[str, ...]:
    """The TEI services that serve while the server does: those whose task a model serves."""
    return serving_names({model.task for model in service.core.models.models})


class Frontend:
    def __init__(self, fcfg: FrontendConfig, cfg: ServeConfig, state: ServerState, executor: ThreadPoolExecutor,
                 channels: list[WorkerChannel], service: EmbedderService):
        self.fcfg, self.cfg, self.state, self.executor = fcfg, cfg, state, executor
        self.channels, self.service = channels, service
        self.grpc, self.health = grpc_server(cfg, service, fcfg.listen)
        self.door = HttpDoor(service.core, metrics.exposition(state)) if fcfg.http_listen else None
        self.http = (HttpServer(self.door.handle, error_response, max_body_bytes=cfg.max_request_bytes,
                                max_connections=cfg.http_max_connections, write_timeout=cfg.http_write_timeout,
                                first_byte_timeout=cfg.http_first_byte_timeout,
                                max_unread_bytes=cfg.http_unread_bytes)
                     if self.door else None)
        self.control = socket.socket(fileno=fcfg.control_fd)
        self.control.setblocking(False)
        self.started = False   # every worker was ready once: SERVING from then on while one is
        # The supervisor said the server has started (every frontend listening, every worker ready);
        # until then a child's death aborts the whole start, so health must not say SERVING.
        self.server_started = False
        self.draining = False
        self.serving: bool | None = None

    @classmethod
    def build(cls, fcfg: FrontendConfig) -> Frontend:
        """Wire the parts; nothing listens yet."""
        cfg = fcfg.serve
        specs = served_specs(cfg)  # with --default-prompt-name and --served-model-name (server/process/served_model.py)
        state = ServerState.attach(fcfg.state)
        executor = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="pollen-tokenize")
        channels = [WorkerChannel(w, fcfg.index, state, spin_us=cfg.frontend_spin_us) for w in range(cfg.workers)]
        for channel in channels:
            channel.model_names = [spec.name for spec in specs]
        router = Router(cfg, channels, state)
        models = ModelTable.build(cfg, specs, router, executor, report=fcfg.index == 0)
        core = Core(cfg, models, router, fcfg.index)
        core.tracer = tracing.start(cfg.otlp_endpoint, fcfg.index)  # None without --otlp-endpoint
        service = EmbedderService(core)
        if cfg.grpc_flood_bytes and fcfg.listen and not fcfg.listen.startswith("unix:"):
            service.flood_guard = FloodGuard(int(fcfg.listen.rpartition(":")[2]), cfg.grpc_flood_bytes)
        frontend = cls(fcfg, cfg, state, executor, channels, service)
        for channel in channels:
            channel.on_ready_change = frontend.update_health
        return frontend

    async def run(self, stop: asyncio.Event) -> None:
        """Open both doors, take the workers' rings, serve until `stop` is set."""
        loop = asyncio.get_running_loop()
        await self.set_health(False)
        await self.grpc.start()
        if self.fcfg.listen.startswith("unix:"):
            os.chmod(self.fcfg.listen.removeprefix("unix:"), int(self.cfg.listen_mode, 8))
        if self.http:
            host, _, port = self.fcfg.http_listen.rpartition(":")
            await self.http.start(host, int(port), reuse_port=True)
        loop.add_reader(self.control.fileno(), self.on_control, stop)
        control.send(self.control, {"kind": "listening"})
        guard = asyncio.create_task(self.service.flood_guard.run()) if self.service.flood_guard else None
        await stop.wait()
        if guard:
            guard.cancel()

    def on_control(self, stop: asyncio.Event) -> None:
        """A message from the supervisor: a worker's ring pair, a worker gone, or the server started."""
        try:
            while (message := control.receive(self.control)) is not None:
                body, fds = message
                if body["kind"] == "worker_up":
                    channel = self.channels[body["worker"]]
                    channel.detach(requeue=True)
                    channel.attach(*RingPair.received(body, fds).attach())
                elif body["kind"] == "worker_down":
                    self.channels[body["worker"]].detach(requeue=True)
                    self.update_health()
                elif body["kind"] == "started":
                    self.server_started = True
                    self.update_health()
        except EOFError:  # the supervisor is gone: so are the workers; stop
            asyncio.get_running_loop().remove_reader(self.control.fileno())
            stop.set()

    def update_health(self) -> None:
        """SERVING once the server has started and every worker has been ready, then while at
        least one is, until draining."""
        self.started = self.started or all(c.ready.is_set() for c in self.channels)
        serving = (self.server_started and self.started and not self.draining
                   and any(c.ready.is_set() for c in self.channels))
        if serving != self.serving:
            asyncio.ensure_future(self.set_health(serving))

    async def set_health(self, serving: bool) -> None:
        self.serving = serving
        code = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        served = health_names(self.service)
        for name in SERVICES + served:
            await self.health.set(name, code)
        for name in TEI_SERVICES:  # a TEI service whose task no model serves never serves (as in TEI)
            if name not in served:
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.door:
            self.door.serving = serving

    async def shutdown(self) -> None:
        """Stop taking calls and finish those received (up to --shutdown-grace). gRPC's stop
        cancels the calls it has taken but not yet handed over, so it comes once they have
        reached the service: from the start of the drain the service holds new calls at its door,
        and a client waiting there sends no more. Once no call has arrived for QUIET_S (at most
        HOLD_S), gRPC stops: it sends GOAWAY and closes the listeners, so that a new call is
        refused UNAVAILABLE (clients may send it again elsewhere), and the calls held and in
        flight go on, with the rest of the grace to finish."""
        grace_end = time.monotonic() + self.cfg.shutdown_grace
        self.draining = True
        self.service.core.drain()  # streams read no more messages and end once those read are answered
        await self.set_health(False)
        if self.http:
            self.http.drain()
        hold_end = time.monotonic() + min(HOLD_S, self.cfg.shutdown_grace / 2)
        while time.monotonic() < hold_end and not self.service.core.quiet_for(QUIET_S):
            await asyncio.sleep(QUIET_S / 4)
        left = max(0.0, grace_end - time.monotonic())
        try:
            await self.health.enter_graceful_shutdown()
            stopping = asyncio.gather(self.grpc.stop(left), self.http.stop(left) if self.http else asyncio.sleep(0))
            await asyncio.sleep(0)  # the stop's first step: gRPC takes no more calls
            self.service.core.door_open.set()
            await stopping
        finally:
            if self.http:
                await self.http.stop(0)
            for channel in self.channels:
                channel.detach(requeue=False)
            metrics.DEFERRED.flush()  # the last counts, before the process goes
            self.executor.shutdown(wait=False, cancel_futures=True)


async def serve(fcfg: FrontendConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    frontend = Frontend.build(fcfg)
    try:
        await frontend.run(stop)
    except Exception as exc:
        control.send(frontend.control, {"kind": "failed", "error": str(exc)})
        raise
    finally:
        await frontend.shutdown()


def main(argv: list[str] | None = None) -> int:
    fcfg = config_from_argv(FrontendConfig, argv, "pollen.server.process.frontend")
    # Ctrl-C reaches the supervisor, which says when to stop; SIGTERM is the supervisor's word.
    bootstrap(f"pollen-frontend[{fcfg.index}]", fcfg.cpu_cores, ignore=(signal.SIGINT,))
    logging.basicConfig(level=fcfg.serve.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s pollen-frontend[{fcfg.index}] %(name)s: %(message)s")
    import uvloop

    try:
        uvloop.run(serve(fcfg))
    except (ValueError, OSError, RuntimeError) as exc:
        logging.getLogger("pollen").error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
