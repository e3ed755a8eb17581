"""Faults an operator meets: SIGTERM under load, a hung worker, a crash loop, a second server on
the same address, the unix socket's mode. Real servers, real signals."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import POLLEN, ServerProcess, aio_channels, free_port, vectors
from tests.test_drops import sample, scrape


def health(target: str) -> str:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.05)


def test_sigterm_answers_every_call_it_received():
    """200 unary calls, SIGTERM 50 ms later: each is answered (OK), or refused UNAVAILABLE if it
    came too late; none is CANCELLED, and the server exits 0."""
    srv = ServerProcess().start()

    async def main():
        channels = aio_channels(srv.listen, 200)
        stubs = [pb_grpc.EmbedderStub(channel) for channel in channels]
        try:
            calls = [asyncio.ensure_future(stubs[i % len(stubs)].Embed(
                pb.EmbedRequest(texts=[f"query {i} about shutting down"]), timeout=120)) for i in range(200)]
            await asyncio.sleep(0.05)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            for channel in channels:
                await channel.close()

    try:
        results = asyncio.run(main())
        codes = [r.code().name if isinstance(r, grpc.RpcError) else "OK" for r in results]
        assert set(codes) <= {"OK", "UNAVAILABLE"}, sorted(set(codes))
        assert codes.count("OK") > 0
        assert all(vectors(r).shape == (1, 384) for r in results if not isinstance(r, Exception))
        assert srv.proc.wait(60) == 0
    finally:
        srv.kill()


def test_a_hung_worker_is_killed_restarted_and_its_requests_answered():
    srv = ServerProcess("--worker-hang-timeout", "3").start()
    try:
        (worker,) = srv.worker_pids()
        os.kill(worker, signal.SIGSTOP)  # alive, holding its rings, making no progress

        async def main():
            async with grpc.aio.insecure_channel(srv.listen) as channel:
                stub = pb_grpc.EmbedderStub(channel)
                # No deadline of their own (they would wait forever behind a hung worker that is
                # never found); the test's 90 s only bounds a failure.
                return await asyncio.gather(*(stub.Embed(pb.EmbedRequest(texts=[f"waiting {i}"]), timeout=90)
                                              for i in range(8)))

        began = time.monotonic()
        replies = asyncio.run(main())  # no deadline: they would wait forever behind a hung worker
        assert all(vectors(r).shape == (1, 384) for r in replies)
        assert time.monotonic() - began < 60
        wait_for(lambda: not os.path.exists(f"/proc/{worker}"), 10, "the hung worker's end")
        assert srv.worker_pids() != [worker]
        assert sample(scrape(srv), "pollen_worker_restarts_total") == 1
        assert health(srv.listen) == "SERVING"
    finally:
        srv.kill()


def test_health_reflects_a_crash_loop_and_requests_never_held_are_not_poisoned():
    """While no worker is ready, health says NOT_SERVING; a request sent then waits through three
    deaths of workers that never held it and is answered by the fourth."""
    srv = ServerProcess().start()
    try:
        killed = set()
        (first,) = srv.worker_pids()
        os.kill(first, signal.SIGKILL)
        killed.add(first)
        wait_for(lambda: health(srv.listen) == "NOT_SERVING", 10, "NOT_SERVING after the death")
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            pending = stub.Embed.future(pb.EmbedRequest(texts=["sent during a crash loop"]), timeout=180)
            for _ in range(3):  # each replacement dies while it loads the model
                pid = wait_for(lambda: [p for p in srv.worker_pids() if p not in killed], 60, "a new worker")[0]
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                assert health(srv.listen) == "NOT_SERVING"
            reply = pending.result(timeout=180)
        assert vectors(reply).shape == (1, 384)
        wait_for(lambda: health(srv.listen) == "SERVING", 60, "SERVING again")
    finally:
        srv.kill()


def run_second(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([POLLEN, "serve", *args], capture_output=True, text=True, timeout=60)


def test_a_second_server_on_the_same_address_refuses_to_start(tmp_path):
    first = ServerProcess(listen=f"unix:{tmp_path}/pollen.sock").start()
    tcp = ServerProcess().start()
    try:
        # The same gRPC port, the same HTTP port, the same unix path: each refused, exit 1.
        for args in (["--listen", tcp.listen, "--http-listen", f"127.0.0.1:{free_port()}"],
                     ["--listen", f"127.0.0.1:{free_port()}", "--http-listen", tcp.http_listen],
                     ["--listen", first.listen, "--http-listen", f"127.0.0.1:{free_port()}"]):
            second = run_second(*args)
            assert second.returncode == 1, second.stderr[-2000:]
            assert "in use by another pollen server" in second.stderr
        # Anything else listening is found too.
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            other.listen()
            second = run_second("--listen", f"127.0.0.1:{other.getsockname()[1]}", "--http-listen",
                                f"127.0.0.1:{free_port()}")
        assert second.returncode == 1 and "in use by another process" in second.stderr
        for srv in (first, tcp):  # the first servers are untouched
            assert srv.healthy()
            with grpc.insecure_channel(srv.listen) as channel:
                reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["still mine"]), timeout=60)
            assert vectors(reply).shape == (1, 384)
    finally:
        first.terminate()
        tcp.terminate()


@pytest.mark.parametrize("mode", [None, "0600"])
def test_the_unix_socket_mode(tmp_path, mode):
    path = tmp_path / "pollen.sock"
    srv = ServerProcess(*(["--listen-mode", mode] if mode else []), listen=f"unix:{path}").start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == int(mode or "0660", 8)
    finally:
        srv.terminate()
