"""kill -9 of a worker with 2,000 requests in flight: every one is answered, correctly."""
from __future__ import annotations

import asyncio
import os
import random
import signal

import grpc
import numpy as np

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, aio_channels, cosine_rows, embed_all_at_once, shm_segments, vectors
from tests.texts import stsb_pairs

REQUESTS = 2000


def test_kill_9_worker_loses_nothing(reference):
    srv = ServerProcess().start()
    try:
        rng = random.Random(5)
        pool = sorted({b for _, b, _ in stsb_pairs()})[:300]
        plan = [rng.sample(range(len(pool)), rng.randint(1, 4)) for _ in range(REQUESTS)]
        ref = reference(pool)
        (victim,) = srv.worker_pids()

        async def main():
            answered = 0
            channels = aio_channels(srv.listen, REQUESTS)
            stubs = [pb_grpc.EmbedderStub(channel) for channel in channels]

            async def one(i, picks):
                nonlocal answered
                reply = await stubs[i % len(stubs)].Embed(pb.EmbedRequest(texts=[pool[j] for j in picks],
                                                                          normalize=True), timeout=300)
                answered += 1
                return reply

            try:
                calls = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(plan)]
                # Kill once the worker is busy and most requests are still waiting.
                while answered < 50:
                    await asyncio.sleep(0.005)
                os.kill(victim, signal.SIGKILL)
                in_flight_at_kill = REQUESTS - answered
                replies = await asyncio.gather(*calls)
                return replies, in_flight_at_kill
            finally:
                for channel in channels:
                    await channel.close()

        replies, in_flight_at_kill = asyncio.run(main())
        print(f"killed worker {victim} with {in_flight_at_kill} requests unanswered")
        assert in_flight_at_kill > 1000
        for picks, reply in zip(plan, replies):
            assert cosine_rows(vectors(reply), ref[picks]).min() >= 0.9999

        (new_worker,) = srv.worker_pids()
        assert new_worker != victim
        assert srv.healthy()
        with grpc.insecure_channel(srv.listen) as channel:
            reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=[pool[0]], normalize=True), timeout=60)
        np.testing.assert_allclose(vectors(reply)[0], ref[0], atol=1e-5)
        # Only the live worker's two rings remain, beside the server state and metrics folder.
        assert len(shm_segments(srv.pid)) == 4
        assert all(not n.startswith("pollen-") or n.startswith(f"pollen-{srv.pid}-") or _owner_alive(n)
                   for n in os.listdir("/dev/shm"))
    finally:
        if srv.proc.poll() is None:
            assert srv.terminate() == 0
        assert shm_segments(srv.pid) == []


def _owner_alive(name: str) -> bool:
    try:
        os.kill(int(name.split("-")[1]), 0)
        return True
    except (ProcessLookupError, ValueError, IndexError):
        return False


def test_small_rings_backlog_and_backpressure_lose_nothing(reference):
    """Rings far smaller than the burst: the frontend's backlog and the worker's wait for
    response space both run, and every answer is still right."""
    srv = ServerProcess("--request-ring-bytes", "65536", "--response-ring-bytes", "65536",
                        "--max-texts-per-request", "16").start()
    try:
        pool = sorted({a for a, _, _ in stsb_pairs()})[:200]
        rng = random.Random(3)
        plan = [rng.sample(range(len(pool)), rng.randint(8, 16)) for _ in range(300)]
        ref = reference(pool)

        requests = [pb.EmbedRequest(texts=[pool[j] for j in picks], normalize=True) for picks in plan]
        for picks, reply in zip(plan, embed_all_at_once(srv.listen, requests)):
            assert cosine_rows(vectors(reply), ref[picks]).min() >= 0.9999
    finally:
        assert srv.terminate() == 0


def test_a_request_in_flight_through_three_worker_deaths_fails_alone():
    srv = ServerProcess().start()
    try:
        big = pb.EmbedRequest(texts=["a long document " * 200] * 64, truncate=pb.TRUNCATE_END)

        async def main():
            async with grpc.aio.insecure_channel(srv.listen) as channel:
                stub = pb_grpc.EmbedderStub(channel)
                call = asyncio.ensure_future(stub.Embed(big, timeout=300))
                killed = set()
                for _ in range(3):
                    while True:  # wait for the current worker (a new one after each death) to be ready
                        pids = set(srv.worker_pids()) - killed
                        if pids and await asyncio.to_thread(srv.healthy):
                            break
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.3)  # it holds the request: only a death that held it counts
                    assert not call.done()
                    (pid,) = pids
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                try:
                    await call
                except grpc.aio.AioRpcError as err:
                    return err
                raise AssertionError("the request survived three worker deaths")

        err = asyncio.run(main())
        assert err.code() == grpc.StatusCode.INTERNAL
        assert "died 3 times" in err.details()
        with grpc.insecure_channel(srv.listen) as channel:  # the next worker serves others
            reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["still serving"]), timeout=120)
        assert vectors(reply).shape == (1, 384)
    finally:
        assert srv.terminate() == 0
