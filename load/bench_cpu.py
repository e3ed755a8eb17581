"""The CPU benchmark: `pollen serve` on its defaults (all-MiniLM-L6-v2 on the CPU) over gRPC on
loopback, beside sentence-transformers on the same texts.

    python load/bench_cpu.py                  # starts its own server, prints a table,
                                              # writes load/results/cpu-cpu.md (load/results_file.py)

Workloads (fixed seeds):
  queries  one short text at a time, sequentially: latency p50 / p99
  docs     STS-B sentences and multi-sentence passages over concurrent streams: texts/s, tokens/s
Reference: sentence-transformers `encode` on the same docs, in this process, batch size 64.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import platform
import random
import sys
import time

import grpc
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load.results_file import add_out_argument, write_result  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402
from tests.texts import stsb_pairs  # noqa: E402


def make_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    sentences = [a for a, _, _ in stsb_pairs()]
    return [" ".join(rng.sample(sentences, rng.choice((1, 1, 2, 4, 8)))) for _ in range(n)]


def queries_latency(target: str, texts: list[str]) -> dict:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        for t in texts[:20]:  # warm-up
            stub.Embed(pb.EmbedRequest(texts=[t]))
        times = []
        for t in texts:
            t0 = time.perf_counter()
            stub.Embed(pb.EmbedRequest(texts=[t], normalize=True))
            times.append((time.perf_counter() - t0) * 1e3)
    q = np.percentile(times, [50, 99])
    return {"requests": len(texts), "p50_ms": round(float(q[0]), 2), "p99_ms": round(float(q[1]), 2)}


async def docs_throughput(target: str, docs: list[str], streams: int, per_message: int) -> dict:
    chunks = [docs[i:i + per_message] for i in range(0, len(docs), per_message)]
    tokens = 0

    async def one_stream(part: list[list[str]]) -> None:
        nonlocal tokens
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EmbedderStub(channel)

            async def requests():
                for i, texts in enumerate(part):
                    yield pb.EmbedRequest(id=str(i), texts=texts, normalize=True, truncate=pb.TRUNCATE_END)

            async for answer in stub.EmbedStream(requests()):
                assert not answer.HasField("error"), answer.error.message
                tokens += answer.usage.prompt_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(one_stream(chunks[s::streams]) for s in range(streams)))
    seconds = time.perf_counter() - t0
    return {"texts": len(docs), "tokens": tokens, "seconds": round(seconds, 2),
            "texts_per_s": round(len(docs) / seconds, 1), "tokens_per_s": round(tokens / seconds)}


def reference_throughput(docs: list[str]) -> dict:
    from sentence_transformers import SentenceTransformer

    from pollen.common.model_spec import default_model_path

    model = SentenceTransformer(default_model_path(), device="cpu")
    model.encode(docs[:64], batch_size=64)
    t0 = time.perf_counter()
    model.encode(docs, batch_size=64, normalize_embeddings=True)
    seconds = time.perf_counter() - t0
    return {"texts": len(docs), "seconds": round(seconds, 2), "texts_per_s": round(len(docs) / seconds, 1)}


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown cpu"
    return f"{name}, {os.cpu_count()} cores"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--per-message", type=int, default=16)
    add_out_argument(parser, "cpu")
    args = parser.parse_args()

    import sentence_transformers
    import torch

    docs = make_docs(args.docs, seed=1)
    queries = [d.split(".")[0] for d in make_docs(args.queries, seed=2)]
    srv = ServerProcess("--log-level", "WARNING").start(timeout=60)
    try:
        startup = round(srv.started_in_s, 2)
        lat = queries_latency(srv.listen, queries)
        thr = asyncio.run(docs_throughput(srv.listen, docs, args.streams, args.per_message))
    finally:
        srv.terminate()
    ref = reference_throughput(docs)

    result = {
        "date": time.strftime("%Y-%m-%d"), "device": machine(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "grpcio": grpc.__version__,
                     "sentence_transformers": sentence_transformers.__version__},
        "model": "all-MiniLM-L6-v2", "server": "pollen serve (defaults: 1 worker, --max-batch-tokens 8192)",
        "startup_to_serving_s": startup, "queries": lat, "docs": thr, "reference_sentence_transformers": ref,
    }
    rows = [
        ("start-up to SERVING", f"{startup} s"),
        (f"queries, 1 text at a time ({lat['requests']})", f"p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms"),
        (f"docs via {args.streams} streams x {args.per_message} texts/message ({thr['texts']} texts)",
         f"{thr['texts_per_s']} texts/s, {thr['tokens_per_s']} tokens/s"),
        ("sentence-transformers encode, batch 64, same docs", f"{ref['texts_per_s']} texts/s"),
    ]
    table = "\n".join(["| workload | result |", "| --- | --- |", *(f"| {a} | {b} |" for a, b in rows)])
    header = (f"{result['device']}; python {result['versions']['python']}, torch {torch.__version__}, grpcio "
              f"{grpc.__version__}, sentence-transformers {sentence_transformers.__version__}; model "
              f"{result['model']}; client, server and reference on the same machine, {result['date']}.\n\n")
    print(table)
    write_result("cpu", "cpu", "pollen over gRPC on the CPU", header + table, result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
