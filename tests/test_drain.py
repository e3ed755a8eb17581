"""SIGTERM under steady load: 64 closed-loop unary clients and 4 streams keep calling while the
server stops. Every call the server received is answered, none CANCELLED; a stream gets the
answers of the messages the server read and then ends UNAVAILABLE, saying so; calls made after
the doors closed are refused UNAVAILABLE; the server exits 0 and leaves /dev/shm clean."""
from __future__ import annotations

import asyncio
import collections
import os
import pathlib
import signal
import threading
import time

import grpc
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, shm_segments

CLIENTS, STREAMS, CONNECTIONS = 64, 4, 8
GRACE_S = 10
STOPPING = "the server is stopping"  # how pollen ends a stream it stopped reading


async def unary_client(stub, outcomes: collections.Counter, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            reply = await stub.Embed(pb.EmbedRequest(texts=["a query under steady load"]), timeout=60)
            outcomes["ok" if reply.rows == 1 else "wrong"] += 1
        except grpc.aio.AioRpcError as err:
            outcomes[(err.code().name, err.details())] += 1
            await asyncio.sleep(0.05)  # refused: the server is gone; do not spin


def stream_client(target: str, n: int, outcomes: collections.Counter, stop: threading.Event) -> None:
    """One EmbedStream, closed loop: the next message once the last one's answer came. The sync
    API, whose request thread leaves the call's status to the server when a write fails."""
    answered = threading.Event()
    sent = []

    def messages():
        while not stop.is_set():
            sent.append(f"s{n}-{len(sent)}")
            yield pb.EmbedRequest(id=sent[-1], texts=["a stream message"])
            answered.wait(30)
            answered.clear()

    with grpc.insecure_channel(target, options=[("pollen.test.stream", n)]) as channel:
        answers = []
        try:
            for response in pb_grpc.EmbedderStub(channel).EmbedStream(messages(), timeout=60):
                assert not response.HasField("error"), response.error.message
                answers.append(response.id)
                answered.set()
            outcomes[("stream", "OK")] += 1
        except grpc.RpcError as err:
            outcomes[("stream", err.code().name, err.details().split(":")[0])] += 1
        assert answers == sent[:len(answers)] and len(sent) - len(answers) <= 1, (sent[-3:], answers[-3:])


async def load_then_sigterm(srv: ServerProcess) -> tuple[collections.Counter, float]:
    outcomes: collections.Counter = collections.Counter()
    stop, stop_streams = asyncio.Event(), threading.Event()
    channels = [grpc.aio.insecure_channel(srv.listen, options=[("pollen.test.connection", i)])
                for i in range(CONNECTIONS)]
    stubs = [pb_grpc.EmbedderStub(c) for c in channels]
    tasks = [asyncio.create_task(unary_client(stubs[i % CONNECTIONS], outcomes, stop)) for i in range(CLIENTS)]
    tasks += [asyncio.create_task(asyncio.to_thread(stream_client, srv.listen, i, outcomes, stop_streams))
              for i in range(STREAMS)]
    t0 = time.monotonic()
    while outcomes["ok"] < 2 * CLIENTS and time.monotonic() - t0 < 30:  # steady load, every client in
        await asyncio.sleep(0.1)
    os.kill(srv.pid, signal.SIGTERM)
    t_term = time.monotonic()
    while srv.proc.poll() is None and time.monotonic() - t_term < GRACE_S + 20:
        await asyncio.sleep(0.05)
    stopped_in = time.monotonic() - t_term
    stop.set()
    stop_streams.set()
    await asyncio.gather(*tasks)
    for channel in channels:
        await channel.close()
    return outcomes, stopped_in


@pytest.mark.slow
@pytest.mark.parametrize("run", range(5))
def test_sigterm_under_steady_load_answers_every_received_call(run, tmp_path):
    log = tmp_path / "server.log"
    srv = ServerProcess("--shutdown-grace", str(GRACE_S), log=str(log)).start()
    try:
        outcomes, stopped_in = asyncio.run(load_then_sigterm(srv))
        print(f"run {run}: stopped in {stopped_in:.1f} s; {dict(outcomes)}")
        assert srv.proc.wait(5) == 0
        assert shm_segments(srv.pid) == []
        errors = {k: v for k, v in outcomes.items() if k != "ok" and k[0] != "stream"}
        assert "wrong" not in outcomes
        # Refused before the server took them (the doors were closed): UNAVAILABLE, never CANCELLED
        # nor gRPC's "Cancelling all calls" at the end of the grace.
        assert all(code == "UNAVAILABLE" and "Cancelling all calls" not in details
                   for code, details in errors), errors
        streams = {k: v for k, v in outcomes.items() if k[0] == "stream"}
        assert sum(streams.values()) == STREAMS
        assert set(streams) <= {("stream", "OK"), ("stream", "UNAVAILABLE", STOPPING)}, streams
        assert outcomes["ok"] >= 2 * CLIENTS
        text = pathlib.Path(log).read_text(errors="replace")
        assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
    finally:
        srv.kill()
