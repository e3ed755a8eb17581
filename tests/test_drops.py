"""Deadlines, cancellation and priority through a real server, read through its /metrics.

A long bulk backlog keeps the worker busy; requests queued behind it either expire (timeout_ms,
gRPC deadline) or are cancelled by their client, and must never reach a forward: the sequences
and tokens the workers ran (pollen_sequences_total, pollen_batch_tokens_sum) are exactly the
backlog's and the answered requests'. Each drop is counted once in pollen_dropped.
"""
from __future__ import annotations

import asyncio
import http.client

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess

# Many one-text requests: the batcher serves requests not yet begun in arrival order (worker/
# batcher.py, fair share), so the later ones below wait behind these, a batch of 8 at a time.
BACKLOG_REQUESTS, BACKLOG_TEXTS = 96, 1


def ids(n: int, first: int) -> pb.TokenIds:
    return pb.TokenIds(ids=[101] + [first + i % 500 for i in range(n - 2)] + [102])


def scrape(server: ServerProcess) -> dict:
    """/metrics as {(name, sorted labels): value}."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def sample(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape_async(server: ServerProcess) -> dict:
    return await asyncio.get_running_loop().run_in_executor(None, scrape, server)


async def scenario(server: ServerProcess) -> dict:
    async with grpc.aio.insecure_channel(server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        bulk = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(
            token_ids=[ids(256, 1000 + r) for _ in range(BACKLOG_TEXTS)], priority=pb.PRIORITY_BULK), timeout=300))
            for r in range(BACKLOG_REQUESTS)]
        while not sample(await scrape_async(server), "pollen_sequences_total"):  # the backlog has begun
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
    server = ServerProcess("--max-batch-tokens", "2048", "--max-texts-per-request", "64").start()
    try:
        got = asyncio.run(scenario(server))
        metrics = scrape(server)
    finally:
        server.terminate()
    assert got["outcomes"] == {"expiring": ["DEADLINE_EXCEEDED"] * 4, "deadlined": ["DEADLINE_EXCEEDED"] * 3,
                               "cancelled": ["CANCELLED"] * 5}
    stream = got["stream"]
    assert sorted(stream) == ["fine", "late-0", "late-1", "late-2"]
    for i in range(3):
        assert stream[f"late-{i}"].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert stream["fine"].rows == 1 and not stream["fine"].HasField("error")  # its neighbours did not fail it
    assert all(b.rows == BACKLOG_TEXTS for b in got["backlog"])

    # Exactly the backlog's sequences and the two interactive texts reached a forward.
    assert sample(metrics, "pollen_sequences_total") == BACKLOG_REQUESTS * BACKLOG_TEXTS + 2
    assert sample(metrics, "pollen_batch_tokens_sum") == (BACKLOG_REQUESTS * BACKLOG_TEXTS * 256
                                                          + got["interactive"].usage.prompt_tokens
                                                          + stream["fine"].usage.prompt_tokens)
    # Each drop counted once: 4 + 3 stream-or-unary timeouts, 3 gRPC deadlines, 5 cancels.
    assert sample(metrics, "pollen_dropped_total", reason="deadline") == 4 + 3 + 3
    assert sample(metrics, "pollen_dropped_total", reason="cancelled") == 5
    # Interactive work overtook the bulk backlog.
    assert got["bulk_done_early"] < BACKLOG_REQUESTS
    batches = sample(metrics, "pollen_batch_tokens_count")
    assert batches and sample(metrics, "pollen_batch_tokens_bucket", le="2048.0") == batches  # all <= 2048
    # Every answered request observed its queue and inference times.
    assert sample(metrics, "pollen_queue_seconds_count") == BACKLOG_REQUESTS + 2
    assert sample(metrics, "pollen_inference_seconds_count") == sample(metrics, "pollen_queue_seconds_count")
    assert sample(metrics, "pollen_queued_tokens") == 0


def test_requests_expire_in_the_frontend_backlog_when_the_ring_is_full():
    # A small request ring: while the worker runs one long batch, most requests wait in the
    # frontend's backlog, where their deadline passes.
    server = ServerProcess("--max-batch-tokens", "16384", "--max-texts-per-request", "16",
                           "--request-ring-bytes", str(64 << 10)).start()
    seen_backlog = []

    async def scenario_fn():
        async with grpc.aio.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            first = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(token_ids=[ids(256, 1000 + i)] * 16)))
                     for i in range(4)]  # 16,384 tokens: one long batch ahead of everything else
            while sample(await scrape_async(server), "pollen_queued_tokens") < 4 * 16 * 256:
                await asyncio.sleep(0.001)
            # 600 ms: long enough for all 40 to arrive before the first expires (on a busy 2-core
            # machine they trickle in over a few hundred ms), far shorter than the 16,384-token
            # batch ahead of them (over a second on the CPU), so none reaches the model.
            late = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(token_ids=[ids(256, 2000 + i)] * 8,
                                                                     timeout_ms=600))) for i in range(40)]
            while not all(call.done() for call in late):
                seen_backlog.append(sample(await scrape_async(server), "pollen_backlog_requests"))
            codes = []
            for call in late:
                try:
                    await call
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
            await asyncio.gather(*first)
            return codes

    try:
        codes = asyncio.run(scenario_fn())
        metrics = scrape(server)
    finally:
        server.terminate()
    assert max(seen_backlog) > 20  # most waited in the frontend's backlog: the ring was full
    assert codes == ["DEADLINE_EXCEEDED"] * 40
    assert sample(metrics, "pollen_sequences_total") == 64  # only the first four requests reached the model
    assert sample(metrics, "pollen_dropped_total", reason="deadline") == 40
