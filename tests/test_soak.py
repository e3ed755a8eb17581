"""A CI-sized soak: 60 s of mixed traffic (unary, streams, HTTP, deadlines, invalid input, cancels)
against one server. Every status is one the request asked for, the queue drains back to zero,
the frontend's memory and every process's open files stay level."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import time

import grpc

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.test_drops import sample, scrape

SECONDS = 60
RSS_GROWTH_MB = 40  # the frontend's resident memory may grow this much after its warm-up


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def open_files(pids: list[int]) -> int:
    return sum(len(os.listdir(f"/proc/{pid}/fd")) for pid in pids)


async def unary_mix(stub, rng: random.Random, end: float, seen: dict) -> None:
    """Valid queries, tight deadlines, invalid options and cancels, each with the statuses it may get."""
    while time.monotonic() < end:
        kind = rng.choice(["ok", "ok", "deadline", "invalid", "cancel"])
        text = " ".join(rng.choice(["soak", "query", "vector", "search", "river"]) for _ in range(rng.randint(2, 12)))
        if kind == "invalid":
            request = pb.EmbedRequest(texts=[text], encoding=99)
        elif kind == "deadline":
            request = pb.EmbedRequest(texts=[text] * 8, timeout_ms=1)
        else:
            request = pb.EmbedRequest(texts=[text])
        call = stub.Embed(request, timeout=60)
        if kind == "cancel":
            await asyncio.sleep(rng.random() * 0.005)
            call.cancel()
        try:
            await call
            code = "OK"
        except asyncio.CancelledError:
            code = "CANCELLED"
        except grpc.RpcError as exc:
            code = exc.code().name
        seen.setdefault((kind, code), 0)
        seen[(kind, code)] += 1


async def stream_mix(stub, rng: random.Random, end: float, seen: dict) -> None:
    """One stream at a time: valid messages and messages without an id, read while written."""
    while time.monotonic() < end:
        messages = [pb.EmbedRequest(id="" if rng.random() < 0.1 else str(i), texts=[f"stream text {i}"])
                    for i in range(rng.randint(5, 40))]

        async def write():
            for m in messages:
                yield m

        async for answer in stub.EmbedStream(write(), timeout=60):
            code = grpc.StatusCode.INVALID_ARGUMENT.name if answer.HasField("error") else "OK"
            kind = "no-id" if not answer.id else "ok"
            seen[(f"stream-{kind}", code)] = seen.get((f"stream-{kind}", code), 0) + 1


def http_mix(port: int, rng: random.Random, end: float, seen: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while time.monotonic() < end:
        bad = rng.random() < 0.2
        body = b"{not json" if bad else json.dumps({"input": [f"http text {rng.random()}"]}).encode()
        conn.request("POST", "/v1/embeddings", body=body)
        reply = conn.getresponse()
        reply.read()
        key = ("http-bad" if bad else "http-ok", reply.status)
        seen[key] = seen.get(key, 0) + 1
    conn.close()


ALLOWED = {("ok", "OK"), ("deadline", "OK"), ("deadline", "DEADLINE_EXCEEDED"), ("invalid", "INVALID_ARGUMENT"),
           ("cancel", "OK"), ("cancel", "CANCELLED"), ("stream-ok", "OK"), ("stream-no-id", "INVALID_ARGUMENT"),
           ("http-ok", 200), ("http-bad", 400)}


def test_sixty_seconds_of_mixed_traffic():
    srv = ServerProcess("--max-texts-per-request", "16").start()
    try:
        frontend = next(p for p in srv.child_pids() if open(f"/proc/{p}/cmdline", "rb").read().startswith(b"pollen-f"))
        pids = [srv.pid, *srv.child_pids()]
        seen: dict = {}

        async def main(seconds: float):
            end = time.monotonic() + seconds
            async with grpc.aio.insecure_channel(srv.listen) as channel:
                stub = pb_grpc.EmbedderStub(channel)
                rngs = [random.Random(seed) for seed in range(8)]
                await asyncio.gather(*(unary_mix(stub, rngs[i], end, seen) for i in range(6)),
                                     *(stream_mix(stub, rngs[6 + i], end, seen) for i in range(2)),
                                     asyncio.to_thread(http_mix, srv.http_port, random.Random(9), end, seen))

        asyncio.run(main(8))  # warm-up: caches, pools and buffers reach their working size
        rss_before, files_before = rss_mb(frontend), open_files(pids)
        asyncio.run(main(SECONDS))
        time.sleep(1)
        metrics = scrape(srv)
        rss_after, files_after = rss_mb(frontend), open_files(pids)
    finally:
        srv.terminate()
    assert set(seen) <= ALLOWED, {k: v for k, v in seen.items() if k not in ALLOWED}
    assert seen.get(("ok", "OK"), 0) > 100 and seen.get(("http-ok", 200), 0) > 20 and seen.get(("stream-ok", "OK"))
    assert seen.get(("invalid", "INVALID_ARGUMENT"), 0) > 10 and seen.get(("cancel", "CANCELLED"), 0) > 0
    assert sample(metrics, "pollen_queued_tokens") == 0 and sample(metrics, "pollen_backlog_requests") == 0
    assert rss_after - rss_before < RSS_GROWTH_MB, (rss_before, rss_after)
    assert abs(files_after - files_before) <= 4, (files_before, files_after)
