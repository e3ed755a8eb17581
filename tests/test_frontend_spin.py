"""--frontend-spin-us: a frontend that sent the only request in flight server-wide polls the
response ring instead of sleeping on its eventfd (server/pipeline/channel.py, `spin`), for at most the
flag's time; a real server with it answers everything, one at a time and concurrently."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from pollen.common.request import RequestOptions
from pollen.server.config import ServeConfig
from pollen.server.pipeline.channel import WorkerChannel
from pollen.server.pipeline.request import Request
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring
from pollen.shared_mem.server_state import ServerState
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, cosine_rows, vectors


def test_frontend_spin_defaults_by_device():
    assert ServeConfig.from_args([], environ={}).frontend_spin_us == 0
    assert ServeConfig.from_args(["--device", "cuda", "--devices", "0"], environ={}).frontend_spin_us == 5000
    assert ServeConfig.from_args(["--frontend-spin-us", "300"], environ={}).frontend_spin_us == 300


def answer_later(ring: Ring, req_id: int, delay_s: float) -> threading.Thread:
    """A thread stands in for the worker (the channel's side is what is under test): after
    `delay_s` it commits one RESULT record, writing the eventfd only if the channel sleeps."""
    def run():
        time.sleep(delay_s)
        ring.write(records.RESULT, records.result_header(req_id, records.OK, 1, 4, pb.ENCODING_FLOAT32, 1, 2),
                   np.arange(4, dtype=np.float32).tobytes())
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_lone_request_is_read_by_polling_and_the_poll_stops_on_its_own():
    state = ServerState.create(frontends=2, workers=1)
    requests, responses = Ring.create(1 << 16), Ring.create(1 << 16)

    async def scenario():
        loop = asyncio.get_running_loop()
        channel = WorkerChannel(0, 0, state, spin_us=200_000)
        channel.attach(requests, responses)
        channel.ready.set()
        # Only polling can read the answers now: the eventfd's reader is gone.
        loop.remove_reader(responses.data_fd)
        future = channel.send(Request([], RequestOptions(), tokens=5, req_id=1, record=b"request one"))
        assert channel.spinning and not responses.consumer_sleeping  # the stand-in will not write the eventfd
        writer = answer_later(responses, 1, 0.02)
        result = await asyncio.wait_for(future, 5)
        writer.join()
        assert result.req_id == 1 and np.frombuffer(result.body, np.float32).tolist() == [0, 1, 2, 3]
        # The poll lasts its time after the answer too (for the client's next call), then stops
        # and the channel sleeps on the eventfd again.
        assert channel.spinning and not channel.inflight
        while channel.spinning:
            await asyncio.sleep(0.01)
        assert time.monotonic_ns() >= channel.spin_until and responses.consumer_sleeping

        # Another frontend has work in flight: no poll (under load nobody spins).
        loop.add_reader(responses.data_fd, channel.read_answers)
        state.publish(1, 0, queued=40, backlog=0)
        future = channel.send(Request([], RequestOptions(), tokens=5, req_id=2, record=b"request two"))
        assert not channel.spinning and responses.consumer_sleeping
        writer = answer_later(responses, 2, 0.01)
        assert (await asyncio.wait_for(future, 5)).req_id == 2  # through the eventfd
        writer.join()
        state.publish(1, 0, queued=0, backlog=0)

        # An answer slower than the spin: the poll gives up after the flag's time, and the
        # eventfd brings the answer.
        channel.spin_ns = 30_000_000
        began = time.monotonic()
        future = channel.send(Request([], RequestOptions(), tokens=5, req_id=3, record=b"request three"))
        assert channel.spinning
        while channel.spinning:
            await asyncio.sleep(0.005)
        assert 0.025 <= time.monotonic() - began < 2.0 and responses.consumer_sleeping and not future.done()
        writer = answer_later(responses, 3, 0.0)
        assert (await asyncio.wait_for(future, 5)).req_id == 3
        writer.join()

    try:
        asyncio.run(scenario())
    finally:
        for ring in (requests, responses):
            ring.close()
            ring.unlink()
        state.close()
        state.unlink()


def test_a_server_whose_frontends_spin_answers_every_request(reference):
    srv = ServerProcess("--frontends", "2", "--frontend-spin-us", "3000", "--log-level", "WARNING").start()
    texts = [f"query number {i} about frontends that poll" for i in range(48)]
    try:
        # Four connections (distinct options), which the kernel spreads over the frontends.
        channels = [grpc.insecure_channel(srv.listen, options=[("pollen.test.connection", i)]) for i in range(4)]
        stubs = [pb_grpc.EmbedderStub(c) for c in channels]

        def embed(i):
            answer = stubs[i % 4].Embed(pb.EmbedRequest(texts=[texts[i]], normalize=True), timeout=30)
            return vectors(answer)[0]

        got = []
        for i in range(24):  # one at a time: the spinning path
            got.append(embed(i))
            if i % 8 == 7:
                time.sleep(0.01)  # past the spin
        with ThreadPoolExecutor(8) as pool:  # several at once: others in flight, so mostly no spin
            got += list(pool.map(embed, range(24, len(texts))))
        for c in channels:
            c.close()
        assert cosine_rows(np.stack(got), reference(texts)).min() >= 0.9999
    finally:
        srv.terminate()
