"""Interactive queries while bulk documents saturate the GPU, through `pollen serve` on its defaults.

    python load/bench_mixed.py --tokenizer TOKENIZER.json [--shape qwen3-0.6b] [--interactive-clients 8]

Same checkpoint and tokenizer as load/bench_concurrency.py; texts tokenized by the server. Writes
load/results/mixed-<kind>.md (load/results_file.py).

  docs         documents (log-normal, median about 200 tokens, up to 2,048) as texts through
               EmbedStream, 4 streams keeping 32 messages of 8 documents in flight: tokens/s
  bulk solo    the same with priority PRIORITY_BULK: tokens/s
  mixed        bulk as above while 8 closed-loop clients send interactive queries (unary):
               the queries' p50 / p99, and bulk tokens/s as a share of bulk solo
  idle         the 8 interactive clients alone: p50 / p99
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import multiprocessing
import os
import random
import shlex
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load import load_clients  # noqa: E402
from load.bench_concurrency import add_model_args, query_texts, server_info, versions  # noqa: E402
from load.corpus import _sentence  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402

STREAMS, WINDOW, PER_MESSAGE = 4, 32, 8


def documents(n: int, seed: int = 6) -> list[str]:
    """Passages of log-normal length (median about 200 tokens), 1 to 120 sentences."""
    rng = random.Random(seed)
    lengths = np.clip(np.round(np.random.default_rng(seed).lognormal(np.log(12), 0.8, n)), 1, 120).astype(int)
    return [" ".join(_sentence(rng) for _ in range(k)) for k in lengths]


@dataclasses.dataclass(frozen=True)
class StreamLoad:
    """How the stream client loads the server: `processes` client processes, each with `streams`
    EmbedStream calls that keep `window` messages of `per_message` texts in flight; the calls of a
    process share one connection, or each has its own (`connection_per_stream`), which the kernel
    spreads over the server's frontends. The first `warm` seconds are not counted. `outputs`: the
    requests' EmbedRequest.outputs (pollen.v1 OUTPUT_* values; empty: the model's default)."""
    processes: int = 2
    streams: int = STREAMS
    window: int = WINDOW
    per_message: int = PER_MESSAGE
    connection_per_stream: bool = False
    warm: float = 1.0
    normalize: bool = False
    outputs: tuple[int, ...] = ()


def stream_docs(target: str, docs: list[str], priority: str, seconds: float, processes: int = 2,
                load: StreamLoad | None = None) -> dict:
    """Tokens/s (answers' usage counted) and texts/s of documents through EmbedStream for `seconds`,
    each stream going round the documents."""
    load = load or StreamLoad(processes=processes)
    parts = [(target, docs[i::load.processes], priority, seconds, load) for i in range(load.processes)]
    if load.processes == 1:  # no process to start
        got = [_stream_process(*parts[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(load.processes) as pool:
            got = pool.starmap(_stream_process, parts)
    tokens, texts = sum(g["tokens"] for g in got), sum(g["texts"] for g in got)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "texts_per_s": texts / seconds, "texts": texts,
            "errors": sum(g["errors"] for g in got)}


def _stream_process(target: str, docs: list[str], priority: str, seconds: float, load: StreamLoad) -> dict:
    import uvloop

    return uvloop.run(_streams(target, docs, priority, seconds, load))


async def _streams(target: str, docs: list[str], priority: str, seconds: float, load: StreamLoad) -> dict:
    import grpc

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    prio = pb.PRIORITY_BULK if priority == "bulk" else pb.PRIORITY_INTERACTIVE
    counted = {"tokens": 0, "texts": 0, "errors": 0}
    start = time.monotonic() + load.warm
    end = start + seconds
    per = load.per_message

    async def one(stub, offset: int) -> None:
        call = stub.EmbedStream(timeout=3600)
        window = asyncio.Semaphore(load.window)

        async def write():
            n = offset
            while time.monotonic() < end:
                await window.acquire()
                chunk = [docs[(n + k) % len(docs)] for k in range(per)]
                await call.write(pb.EmbedRequest(id=str(n), texts=chunk, truncate=pb.TRUNCATE_END, priority=prio,
                                                 normalize=load.normalize, outputs=load.outputs))
                n += per * load.streams
            await call.done_writing()

        writer = asyncio.create_task(write())
        async for answer in call:
            window.release()
            if answer.HasField("error"):
                counted["errors"] += 1
            elif start <= time.monotonic() <= end:
                counted["tokens"] += answer.usage.prompt_tokens
                # A sparse or token-vector answer without dense rows counts its texts by their rows there.
                counted["texts"] += answer.rows or len(answer.sparse_counts) or len(answer.token_counts)
        await writer

    # A channel option of its own makes each stream's channel a connection of its own; answers of
    # token vectors (a vector per token) pass gRPC's default 4 MB bound.
    channels = [grpc.aio.insecure_channel(target, options=[("pollen.load.connection", i),
                                                           ("grpc.max_receive_message_length", -1)])
                for i in range(load.streams if load.connection_per_stream else 1)]
    try:
        stubs = [pb_grpc.EmbedderStub(c) for c in channels]
        await asyncio.gather(*(one(stubs[i % len(stubs)], i * per) for i in range(load.streams)))
    finally:
        for c in channels:
            await c.close()
    return counted


def main() -> None:
    from load.gpu_models import make_checkpoint, with_tokenizer
    from tests.conftest import ServerProcess

    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--interactive-clients", type=int, default=8)
    p.add_argument("--server-flags", default="")
    add_out_argument(p, "mixed")
    args = p.parse_args()

    path = with_tokenizer(make_checkpoint(args.shape, args.root), args.tokenizer)
    docs, texts = documents(20000), query_texts()
    result = {"meta": versions()}
    server = ServerProcess("--model", path, "--device", args.device, "--log-level", "WARNING",
                           *shlex.split(args.server_flags)).start(timeout=600)
    try:
        result["server"] = server_info(server.listen)
        result["docs"] = stream_docs(server.listen, docs, "interactive", args.seconds)
        print("docs", result["docs"], flush=True)
        result["bulk_solo"] = stream_docs(server.listen, docs, "bulk", args.seconds)
        print("bulk solo", result["bulk_solo"], flush=True)
        result["idle"] = load_clients.run("unary", server.listen, server.http_listen, args.interactive_clients,
                                          2, texts, 1.0, args.seconds)
        print("interactive alone", result["idle"], flush=True)
        before = worker_seconds(server.http_listen)
        with concurrent.futures.ThreadPoolExecutor(1) as thread:  # bulk's own client processes
            bulk = thread.submit(stream_docs, server.listen, docs, "bulk", args.seconds + 2)
            time.sleep(2.0)  # bulk saturates first
            result["mixed"] = load_clients.run("unary", server.listen, server.http_listen,
                                               args.interactive_clients, 2, texts, 1.0, args.seconds - 1)
            result["mixed_bulk"] = bulk.result()
        after = worker_seconds(server.http_listen)
        # Where the worker's one thread spent the mixed run (bulk's whole stream, about --seconds + 2).
        result["mixed_worker_seconds"] = {k: after[k] - before.get(k, 0.0) for k in after}
        result["mixed_bulk"]["share_of_solo"] = result["mixed_bulk"]["tokens_per_s"] / result["bulk_solo"]["tokens_per_s"]
        print("mixed", result["mixed"], result["mixed_bulk"], flush=True)
    finally:
        server.terminate()
    write_result("mixed", device_kind(args.device), "Interactive queries under bulk load through `pollen serve`",
                 header(result) + table(result, args.interactive_clients), result, args.out)


def worker_seconds(http_target: str) -> dict[str, float]:
    """pollen_worker_seconds by phase, summed over workers, from /metrics."""
    import urllib.request

    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://{http_target}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("pollen_worker_seconds"):
                name, value = line.rsplit(" ", 1)
                phase = name.split('phase="', 1)[1].split('"', 1)[0]
                out[phase] = out.get(phase, 0.0) + float(value)
    return out


def ms(r: dict) -> str:
    return f"p50 {r['p50_ms']:.2f} / p99 {r['p99_ms']:.2f} ms" if r["p50_ms"] is not None else "none answered"


def header(result: dict) -> str:
    m, s = result["meta"], result["server"]
    return (f"{m.get('gpu', 'CPU')}, {m['cores']} cores, torch {m['torch']}, grpcio {m['grpcio']}, {m['date']}; "
            f"{s['frontends']} frontends, {s['workers']} worker(s), server defaults.\n\n")


def table(result: dict, interactive_clients: int) -> str:
    return ("| figure | value |\n| --- | --- |\n"
            f"| docs as texts through EmbedStream | {result['docs']['tokens_per_s']:,.0f} tokens/s |\n"
            f"| bulk alone (PRIORITY_BULK) | {result['bulk_solo']['tokens_per_s']:,.0f} tokens/s |\n"
            f"| {interactive_clients} interactive clients alone | {ms(result['idle'])} |\n"
            f"| the same under bulk | {ms(result['mixed'])} |\n"
            f"| bulk beside them | {result['mixed_bulk']['tokens_per_s']:,.0f} tokens/s "
            f"({result['mixed_bulk']['share_of_solo']:.0%} of alone) |\n"
            + ("| the worker's loop during that run, seconds by phase | " + ", ".join(
                f"{k} {v:.2f}" for k, v in result["mixed_worker_seconds"].items()) + " |\n"
               if result.get("mixed_worker_seconds") else ""))


if __name__ == "__main__":
    main()
