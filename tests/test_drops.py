"""Deadlines, cancellation and priority through a real server run in this process, so the test
reads the metrics and the workers' batch reports directly.

A long bulk backlog keeps the worker busy; requests queued behind it either expire (timeout_ms,
gRPC deadline) or are cancelled by their client, and must never reach a forward: the sequences
the worker reports having run are exactly the backlog's and the answered requests'. Each drop is
counted once in pollen_dropped.
"""
from __future__ import annotations

import asyncio

import grpc
import numpy as np

from pollen.server import metrics
from pollen.server.app import serve
from pollen.server.config import ServeConfig
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import free_port

BACKLOG_REQUESTS, BACKLOG_TEXTS = 6, 16


def ids(n: int, first: int) -> pb.TokenIds:
    return pb.TokenIds(ids=[101] + [first + i % 500 for i in range(n - 2)] + [102])


def dropped(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("pollen_dropped_total", {"reason": reason}) or 0.0


def sample(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def run_server(cfg: ServeConfig, scenario_fn):
    """Serve `cfg` in this process while `scenario_fn(pool, reports)` runs; return its result."""
    reports: list = []

    async def main():
        stop = asyncio.Event()
        ready = asyncio.get_running_loop().create_future()

        def serving(pool):
            pool.set_batch_listener(lambda index, report: reports.append(report))
            ready.set_result(pool)

        server = asyncio.ensure_future(serve(cfg, stop, serving))
        pool = await asyncio.wait_for(asyncio.shield(ready), 120)
        try:
            return await scenario_fn(pool, reports)
        finally:
            stop.set()
            await server

    return asyncio.run(main()), reports


async def scenario(listen: str, reports: list) -> dict:
    async with grpc.aio.insecure_channel(listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        bulk = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(
            token_ids=[ids(256, 1000 + r) for _ in range(BACKLOG_TEXTS)], priority=pb.PRIORITY_BULK), timeout=300))
            for r in range(BACKLOG_REQUESTS)]
        while not reports:  # the worker has started on the backlog
            await asyncio.sleep(0.01)

        # Behind the backlog: expiring by timeout_ms (unary and stream), by gRPC deadline, and
        # cancelled by the client.
        expiring = [stub.Embed(pb.EmbedRequest(token_ids=[ids(40, 3000)], priority=pb.PRIORITY_BULK, timeout_ms=30),
                               timeout=300) for _ in range(4)]
        deadlined = [stub.Embed(pb.EmbedRequest(token_ids=[ids(40, 4000)], priority=pb.PRIORITY_BULK), timeout=0.3)
                     for _ in range(3)]
        cancelled = [stub.Embed(pb.EmbedRequest(token_ids=[ids(40, 5000)], priority=pb.PRIORITY_BULK), timeout=300)
                     for _ in range(5)]

        async def stream_messages():
            for i in range(3):
                yield pb.EmbedRequest(id=f"late-{i}", token_ids=[ids(40, 6000)], priority=pb.PRIORITY_BULK,
                                      timeout_ms=30)
            yield pb.EmbedRequest(id="fine", texts=["an interactive message"])

        stream_answers = asyncio.ensure_future(_collect(stub.EmbedStream(stream_messages(), timeout=300)))
        interactive = await stub.Embed(pb.EmbedRequest(texts=["an interactive query"]), timeout=300)
        bulk_done_when_interactive_answered = sum(b.done() for b in bulk)

        await asyncio.sleep(0.4)
        for call in cancelled:
            call.cancel()
        outcomes = {"expiring": [], "deadlined": [], "cancelled": []}
        for name, calls in (("expiring", expiring), ("deadlined", deadlined), ("cancelled", cancelled)):
            for call in calls:
                try:
                    await call
                    outcomes[name].append("OK")
                except asyncio.CancelledError:
                    outcomes[name].append("CANCELLED")
                except grpc.RpcError as exc:
                    outcomes[name].append(exc.code().name)
        backlog = await asyncio.gather(*bulk)
        return {"outcomes": outcomes, "stream": await stream_answers, "interactive": interactive,
                "bulk_done_early": bulk_done_when_interactive_answered, "backlog": backlog}


async def _collect(call) -> dict:
    return {answer.id: answer async for answer in call}


def test_expired_and_cancelled_requests_never_reach_the_model():
    cfg = ServeConfig(listen=f"127.0.0.1:{free_port()}", max_batch_tokens=2048, max_texts_per_request=64)
    before = {r: dropped(r) for r in ("deadline", "cancelled")}
    answered_before = sample("pollen_queue_seconds_count")
    batches_before = sample("pollen_batch_tokens_count")

    got, reports = run_server(cfg, lambda pool, reports: scenario(cfg.listen, reports))
    assert got["outcomes"] == {"expiring": ["DEADLINE_EXCEEDED"] * 4, "deadlined": ["DEADLINE_EXCEEDED"] * 3,
                               "cancelled": ["CANCELLED"] * 5}
    stream = got["stream"]
    assert sorted(stream) == ["fine", "late-0", "late-1", "late-2"]
    for i in range(3):
        assert stream[f"late-{i}"].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert stream["fine"].rows == 1 and not stream["fine"].HasField("error")  # its neighbours did not fail it
    assert all(b.rows == BACKLOG_TEXTS for b in got["backlog"])

    # Exactly the backlog's sequences and the two interactive texts reached a forward.
    assert sum(r.seqs for r in reports) == BACKLOG_REQUESTS * BACKLOG_TEXTS + 2
    assert sum(r.tokens for r in reports) == (BACKLOG_REQUESTS * BACKLOG_TEXTS * 256
                                              + got["interactive"].usage.prompt_tokens
                                              + stream["fine"].usage.prompt_tokens)
    # Each drop counted once: 4 + 3 stream-or-unary timeouts, 3 gRPC deadlines, 5 cancels.
    assert dropped("deadline") - before["deadline"] == 4 + 3 + 3
    assert dropped("cancelled") - before["cancelled"] == 5
    # Interactive work overtook the bulk backlog.
    assert got["bulk_done_early"] < BACKLOG_REQUESTS
    assert np.all([r.tokens <= 2048 for r in reports])
    # Every answered request observed its queue and inference times, every batch its tokens.
    assert sample("pollen_queue_seconds_count") - answered_before == BACKLOG_REQUESTS + 2
    assert sample("pollen_inference_seconds_count") >= sample("pollen_queue_seconds_count")
    assert sample("pollen_batch_tokens_count") - batches_before == len(reports)
    assert sample("pollen_queued_tokens") == 0


def test_requests_expire_in_the_frontend_backlog_when_the_ring_is_full():
    # A small request ring: while the worker runs one long batch, most requests wait in the
    # frontend's backlog, where their deadline passes.
    cfg = ServeConfig(listen=f"127.0.0.1:{free_port()}", max_batch_tokens=8192, max_texts_per_request=8,
                      request_ring_bytes=64 << 10)
    before = dropped("deadline")
    seen_backlog = []

    async def scenario_fn(pool, reports):
        handle = pool.channels[0]

        def backlogged() -> int:
            return sum(len(lane) for lane in handle.backlog)

        async with grpc.aio.insecure_channel(cfg.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            first = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(token_ids=[ids(256, 1000 + i)] * 8)))
                     for i in range(4)]  # 8192 tokens: long batches ahead of everything else
            while len(handle.inflight) < 4 or backlogged():
                await asyncio.sleep(0.001)
            late = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(token_ids=[ids(256, 2000 + i)] * 8,
                                                                     timeout_ms=50))) for i in range(40)]
            while not all(call.done() for call in late):
                seen_backlog.append(backlogged())
                await asyncio.sleep(0.001)
            codes = []
            for call in late:
                try:
                    await call
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
            await asyncio.gather(*first)
            return codes

    codes, reports = run_server(cfg, scenario_fn)
    assert max(seen_backlog) > 20  # most waited in the frontend's backlog: the ring was full
    assert codes == ["DEADLINE_EXCEEDED"] * 40
    assert sum(r.seqs for r in reports) == 32  # only the first four requests reached the model
    assert dropped("deadline") - before == 40
