"""Shared fixtures: a real `pollen serve` process, gRPC stubs, and the sentence-transformers reference."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The README's command, installed next to this interpreter by `pip install -e .`.
POLLEN = os.path.join(os.path.dirname(sys.executable), "pollen")

# The limit for a 2-core machine; a server slower than this fails the fixture.
SERVING_WITHIN_S = 15.0

# Every server a test started, so that none outlives the run whatever path its test took.
STARTED: list[ServerProcess] = []

# The servers' ONNX exports (--onnx-cache) go to a folder of this run unless the environment names
# one, so that a run neither reads a user's exports nor leaves its tiny checkpoints' in their cache.
if not os.environ.get("POLLEN_ONNX_CACHE"):
    os.environ["POLLEN_ONNX_CACHE"] = tempfile.mkdtemp(prefix="pollen-test-onnx-")


def flag_values(args: list[str], flag: str) -> list[str]:
    """Every value a flag is given in `args` (--flag V and --flag=V)."""
    values = [v for a, v in zip(args, args[1:]) if a == flag]
    return values + [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


def exports_made(args: list[str], env: dict) -> None:
    """The ONNX exports this server's start would make, made first, in the run's cache: a first
    start's one-time export of a fresh checkpoint is not what SERVING_WITHIN_S bounds. A model that
    cannot be read or exported is left to the server, which says why (so is a server given a
    cache of its own)."""
    if ("cuda" in flag_values(args, "--device") or "torch" in flag_values(args, "--cpu-engine")
            or flag_values(args, "--onnx-cache")):  # a test of its own cache sees the server export
        return
    from pollen.common.model_spec import default_model_path, read_model_spec
    try:
        from pollen.common.onnx_cache import pollen_exports
        from pollen.server.process.cpu_engines import onnx_refusal
    except ImportError:  # an older pollen, without the ONNX engine (load/ab_commits.sh installs one)
        return
    models = flag_values(args, "--model") or (env.get("POLLEN_MODEL") or str(default_model_path())).split(",")
    tasks = flag_values(args, "--task") or ["auto"]
    specs = []
    for path, task in zip(models, tasks * len(models) if len(tasks) == 1 else tasks):
        try:
            spec = read_model_spec(path, task=task)
        except Exception:  # noqa: BLE001 - a test of a refusal: the server says it
            continue
        if onnx_refusal(spec, "float32") is None:
            specs.append(spec)
    if specs:
        pollen_exports(specs, env["POLLEN_ONNX_CACHE"])


def pytest_sessionfinish(session, exitstatus):
    for server in STARTED:
        server.kill()
    if os.path.basename(os.environ["POLLEN_ONNX_CACHE"]).startswith("pollen-test-onnx-"):
        shutil.rmtree(os.environ["POLLEN_ONNX_CACHE"], ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pollen serve` in its own process, as a user would start it."""

    def __init__(self, *args: str, env: dict | None = None, listen: str | None = None,
                 http_listen: str | None = None, log: str | None = None):
        self.listen = listen or f"127.0.0.1:{free_port()}"
        # Always a free port of its own: the default (8080) would collide between servers.
        self.http_listen = http_listen or f"127.0.0.1:{free_port()}"
        self.args = ["serve", "--listen", self.listen, "--http-listen", self.http_listen, *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.started_in_s = None
        self.log = log  # a file for the server's stderr (its log); None: this process's stderr

    def start(self, timeout: float = SERVING_WITHIN_S) -> ServerProcess:
        exports_made(self.args, self.env)
        t0 = time.monotonic()
        with open(self.log, "ab") if self.log else contextlib.nullcontext() as stderr:
            self.proc = subprocess.Popen([POLLEN, *self.args], env=self.env, stderr=stderr)
        STARTED.append(self)
        channel = grpc.insecure_channel(self.listen)
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pollen serve exited with {self.proc.returncode} before serving")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    self.started_in_s = time.monotonic() - t0
                    channel.close()
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        channel.close()
        self.kill()
        raise TimeoutError(f"pollen serve did not report SERVING within {timeout} s")

    @property
    def http_port(self) -> int:
        return int(self.http_listen.rpartition(":")[2])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def child_pids(self) -> list[int]:
        """Every process the server started (frontends and workers)."""
        with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
            return [int(p) for p in f.read().split()]

    def worker_pids(self) -> list[int]:
        """The workers among the children, by their process titles (pollen-worker[i] ...)."""
        pids = []
        for pid in self.child_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().startswith(b"pollen-worker["):
                        pids.append(pid)
            except (FileNotFoundError, ProcessLookupError):  # a child that died since child_pids (tests kill them)
                continue
        return pids

    def healthy(self) -> bool:
        with grpc.insecure_channel(self.listen) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# Calls a test client keeps in flight on one connection: a quarter of the server's
# --grpc-max-streams-per-connection, which counts a stream until gRPC has torn it down, so a
# connection with nearly that many calls in flight has new ones refused REFUSED_STREAM.
IN_FLIGHT_PER_CONNECTION = 64


def aio_channels(target: str, calls: int) -> list:
    """As many aio channels as `calls` in flight at once need, IN_FLIGHT_PER_CONNECTION on each;
    a channel argument of its own keeps gRPC from sharing one connection between them."""
    return [grpc.aio.insecure_channel(target, options=[("pollen.test.connection", i)])
            for i in range(max(1, -(-calls // IN_FLIGHT_PER_CONNECTION)))]


def embed_all_at_once(target: str, requests: list, timeout: float = 300, return_exceptions: bool = False) -> list:
    """Send every request as its own unary Embed, all in flight together, over aio_channels."""
    async def main():
        channels = aio_channels(target, len(requests))
        stubs = [pb_grpc.EmbedderStub(channel) for channel in channels]
        try:
            return await asyncio.gather(*(stubs[i % len(stubs)].Embed(r, timeout=timeout)
                                          for i, r in enumerate(requests)), return_exceptions=return_exceptions)
        finally:
            for channel in channels:
                await channel.close()

    return asyncio.run(main())


def shm_segments(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"pollen-{pid}-"))


@pytest.fixture(scope="session")
def server():
    # --openai-token-ids: the HTTP tests send the model's own ids (its default refusal: test_langchain_openai.py).
    srv = ServerProcess("--max-texts-per-request", "64", "--max-request-bytes", str(1 << 20),
                        "--openai-token-ids", "on").start()
    yield srv
    assert srv.terminate() == 0
    assert shm_segments(srv.pid) == []


@pytest.fixture(scope="session")
def channel(server):
    with grpc.insecure_channel(server.listen) as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel):
    return pb_grpc.EmbedderStub(channel)


@pytest.fixture(scope="session")
def reference():
    """sentence-transformers on the same model: the independent reference."""
    from sentence_transformers import SentenceTransformer

    from pollen.common.model_spec import default_model_path

    model = SentenceTransformer(default_model_path(), device="cpu")

    def encode(texts: list[str]) -> np.ndarray:
        return model.encode(texts, normalize_embeddings=True, batch_size=64, convert_to_numpy=True)

    return encode


def vectors(response: pb.EmbedResponse) -> np.ndarray:
    assert not response.HasField("error"), response.error.message
    assert response.encoding == pb.ENCODING_FLOAT32
    return np.frombuffer(response.embeddings, dtype="<f4").reshape(response.rows, response.dims)


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)
