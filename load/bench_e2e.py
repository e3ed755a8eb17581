"""The GPU engine's workloads end to end: `pollen serve --device cuda` over gRPC on loopback, client
and server on the same machine, against the engine alone in the same run.

    python load/bench_e2e.py [--shape qwen3-0.6b] [--docs-only] [--engine-options skinny=0,...]

queries: one pre-tokenized text of 8..32 tokens per unary Embed, sequentially (p50 / p99); also as
         text (tokenized by the server), and with the worker sleeping between queries instead of
         polling its ring (--worker-spin-us 0; the default on cuda polls 5 ms).
docs:    the bench_engine docs workload as token ids, 16 texts a message, over 4 streams that each
         keep 32 messages in flight (tokens/s), next to the engine's own tokens/s on the same texts.
Writes load/results/e2e-<kind>.md (load/results_file.py).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.bench_engine import BUDGET, DOCS, docs, ours_throughput, queries, versions  # noqa: E402
from load.gpu_models import SHAPES, make_checkpoint  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402
from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402


def engine_docs(path, seqs, budget, options, quantization="none"):
    from pollen.worker.cuda_engine import CudaEngine
    from pollen.worker.models.loader import load_model

    # The server's defaults: graphs up to 8,192 tokens, larger batches eager.
    engine = CudaEngine(load_model(path, device="cuda", dtype=torch.bfloat16, options=options,
                                   quantization=quantization), "cuda",
                        max_batch_tokens=budget, graph_max_tokens=8192)
    engine.warm_up()
    ours_throughput(engine, seqs[:2000], budget)
    secs = ours_throughput(engine, seqs, budget)
    del engine
    torch.cuda.empty_cache()
    return sum(len(s) for s in seqs) / secs


def text_queries(n, seed=4):
    """Short English-like queries of about 8 to 32 tokens."""
    rng = np.random.default_rng(seed)
    words = "what how why which search engine embedding vector query model server latency gpu text the a of".split()
    return [" ".join(rng.choice(words, rng.integers(6, 28))) for _ in range(n)]


def query_latency(target, seqs, texts=False):
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        if texts:
            reqs = [pb.EmbedRequest(texts=[t], normalize=True) for t in seqs]
        else:
            reqs = [pb.EmbedRequest(token_ids=[pb.TokenIds(ids=s.tolist())], normalize=True) for s in seqs]
        for r in reqs[:30]:
            stub.Embed(r)
        times = []
        for r in reqs[30:]:
            t = time.perf_counter()
            stub.Embed(r)
            times.append(time.perf_counter() - t)
        floor = []  # Info: a unary round trip through the same gRPC stack that never reaches a worker
        for _ in range(300):
            t = time.perf_counter()
            stub.Info(pb.InfoRequest())
            floor.append(time.perf_counter() - t)
    ms = np.array(times) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "n": len(ms),
            "grpc_info_p50_ms": float(np.percentile(floor, 50) * 1e3)}


async def stream_docs(target, seqs, streams=4, per_message=16, window=32):
    messages = [pb.EmbedRequest(id=str(i), token_ids=[pb.TokenIds(ids=s.tolist()) for s in seqs[j:j + per_message]],
                                normalize=True)
                for i, j in enumerate(range(0, len(seqs), per_message))]
    parts = [messages[i::streams] for i in range(streams)]

    async def one(part, stub):
        call = stub.EmbedStream()
        sem = asyncio.Semaphore(window)
        answered = 0

        async def write():
            for m in part:
                await sem.acquire()
                await call.write(m)
            await call.done_writing()

        writer = asyncio.create_task(write())
        async for answer in call:
            if answer.HasField("error"):
                raise RuntimeError(answer.error.message)
            answered += 1
            sem.release()
        await writer
        assert answered == len(part)

    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20),
                                                          ("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.EmbedderStub(ch)
        await one(messages[:20], stub)  # warm-up: captures the common graph buckets
        t = time.perf_counter()
        await asyncio.gather(*(one(p, stub) for p in parts))
        return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    add_out_argument(p, "e2e")
    p.add_argument("--docs-scale", type=float, default=1.0)
    p.add_argument("--skip-spin-compare", action="store_true", help="no second server with --worker-spin-us 0")
    p.add_argument("--docs-only", action="store_true",
                   help="the docs through EmbedStream alone: no engine-alone figure, no queries, no second server")
    p.add_argument("--engine-options", type=EngineOptions.parse, default=EngineOptions(),
                   help="NAME=VALUE,... of pollen.common.engine_options.EngineOptions, for the engine and the servers")
    p.add_argument("--quantization", default="none", choices=("none", "fp8"),
                   help="the engine's and the servers' products (pollen serve --quantization)")
    args = p.parse_args()
    path = make_checkpoint(args.shape, args.root)
    vocab = SHAPES[args.shape]["vocab_size"]
    # The server wants a budget that holds the model's longest text (32,768 tokens for Qwen3);
    # the engine-alone figure uses the same budget.
    budget = max(BUDGET[args.shape], SHAPES[args.shape]["max_position_embeddings"])
    hi = 512 if SHAPES[args.shape]["kind"] == "bert" else 2048
    d = docs(int(DOCS[args.shape] * args.docs_scale), vocab, hi)
    tokens = sum(len(s) for s in d)
    res = {"meta": versions(), "shape": args.shape, "engine_options": dataclasses.asdict(args.engine_options),
           "quantization": args.quantization}
    if not args.docs_only:
        res["engine_docs_tokens_per_s"] = engine_docs(path, d, budget, args.engine_options, args.quantization)
        print("engine", res, flush=True)
    flags = ["--model", path, "--device", "cuda", "--max-batch-tokens", str(budget), "--max-request-bytes",
             str(64 << 20), "--max-queued-tokens", str(64 << 20), "--max-texts-per-request", "32",
             "--quantization", args.quantization, *args.engine_options.serve_flags()]
    server = ServerProcess(*flags, env={"PYTHONUNBUFFERED": "1"}).start(timeout=300)
    try:
        res["server_start_s"] = server.started_in_s
        if not args.docs_only:
            res["queries"] = query_latency(server.listen, queries(330, vocab))
            print("queries", res["queries"], flush=True)
            res["queries_text"] = query_latency(server.listen, text_queries(330), texts=True)
            print("queries as text", res["queries_text"], flush=True)
        secs = asyncio.run(stream_docs(server.listen, d))
        res["docs"] = {"tokens_per_s": tokens / secs, "seconds": secs, "tokens": tokens}
        if "engine_docs_tokens_per_s" in res:
            res["docs"]["share_of_engine"] = tokens / secs / res["engine_docs_tokens_per_s"]
        print("docs", res["docs"], flush=True)
        res["sigterm_exit_code"] = server.terminate()  # drains and exits 0, GPU worker included
    finally:
        server.kill()
    if not (args.skip_spin_compare or args.docs_only):
        server = ServerProcess(*flags, "--worker-spin-us", "0", env={"PYTHONUNBUFFERED": "1"}).start(timeout=300)
        try:
            res["queries_no_spin"] = query_latency(server.listen, queries(330, vocab))
            print("queries, worker sleeping between them", res["queries_no_spin"], flush=True)
            server.terminate()
        finally:
            server.kill()
    md = markdown(res, args)
    print(md)
    write_result("e2e", device_kind(), "End to end through `pollen serve --device cuda`", md, res, args.out)


def markdown(res: dict, args) -> str:
    m = res["meta"]
    md = (f"{m['gpu']}, driver {m['driver']}, torch {m['torch']}, {m['date']}; client and server on the same "
          "machine, gRPC on loopback, pre-tokenized input.")
    if res.get("quantization", "none") != "none":
        md += f" Engine and server with --quantization {res['quantization']}."
    if "queries" in res:
        md += f" gRPC round-trip floor (Info) p50 {res['queries']['grpc_info_p50_ms']:.2f} ms."
    engine, q = res.get("engine_docs_tokens_per_s"), res.get("queries")
    cells = [args.shape, f"{q['p50_ms']:.2f} / {q['p99_ms']:.2f}" if q else "-", f"{res['docs']['tokens_per_s']:,.0f}",
             f"{engine:,.0f}" if engine else "-", f"{res['docs']['share_of_engine']:.0%}" if engine else "-"]
    md += ("\n\n| shape | queries p50 / p99 (ms) | docs tokens/s | engine alone, same texts | share |\n"
           "| --- | --- | --- | --- | --- |\n| " + " | ".join(cells) + " |\n")
    if "queries_text" in res:
        md += (f"\nQueries sent as text (tokenized by the server): p50 {res['queries_text']['p50_ms']:.2f} / p99 "
               f"{res['queries_text']['p99_ms']:.2f} ms.")
    if "queries_no_spin" in res:
        md += (f" With the worker sleeping between queries (`--worker-spin-us 0`): p50 "
               f"{res['queries_no_spin']['p50_ms']:.2f} / p99 {res['queries_no_spin']['p99_ms']:.2f} ms.")
    return md + "\n"


if __name__ == "__main__":
    main()
