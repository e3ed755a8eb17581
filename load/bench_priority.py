"""Priority lanes under load: interactive latency while bulk traffic saturates the worker.

    python load/bench_priority.py      # starts `pollen serve` once per --bulk-batch-tokens value,
                                       # prints a table, writes load/results/priority-cpu-<date>.{json,md}

For each --bulk-batch-tokens value (0 = no cap, i.e. --max-batch-tokens):
  idle      interactive queries one at a time on the idle server: p50 / p99
  batch     one bulk request of exactly that many tokens on the idle server: its inference_us,
            the duration of one bulk batch (median of 5)
  loaded    bulk senders keep ~12k tokens in flight (4 x 128-token sequences a request) while
            interactive queries arrive every 0.25 s (open loop): their p50 / p99, and the bulk
            tokens/s over the same window
The claim under test: loaded p50 <= idle p50 + one bulk batch.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import pathlib
import platform
import subprocess
import sys
import time

import grpc
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load.bench_grpc import machine  # noqa: E402
from load.results_file import write_results  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402
from tests.texts import stsb_pairs  # noqa: E402

SEQ_TOKENS = 128


def bulk_ids(rng: np.random.Generator) -> pb.TokenIds:
    return pb.TokenIds(ids=[101, *rng.integers(1000, 29000, SEQ_TOKENS - 2).tolist(), 102])


def pct(values: list[float]) -> dict:
    q = np.percentile(values, [50, 99])
    return {"n": len(values), "p50_ms": round(float(q[0]), 1), "p99_ms": round(float(q[1]), 1)}


async def measure(target: str, cap: int, max_batch_tokens: int, queries: list[str], load_s: float) -> dict:
    rng = np.random.default_rng(0)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)

        async def query(text: str) -> float:
            t0 = time.perf_counter()
            await stub.Embed(pb.EmbedRequest(texts=[text], normalize=True))
            return (time.perf_counter() - t0) * 1e3

        for q in queries[:10]:  # warm-up
            await query(q)
        idle = [await query(q) for q in queries[:40]]

        batch_tokens = cap or max_batch_tokens
        batch = []
        for _ in range(5):
            reply = await stub.Embed(pb.EmbedRequest(token_ids=[bulk_ids(rng) for _ in range(batch_tokens // SEQ_TOKENS)],
                                                     priority=pb.PRIORITY_BULK))
            batch.append(reply.timing.inference_us / 1e3)

        stop = asyncio.Event()
        bulk_tokens = []  # (answer time, tokens)

        async def bulk_sender() -> None:
            while not stop.is_set():
                reply = await stub.Embed(pb.EmbedRequest(token_ids=[bulk_ids(rng) for _ in range(4)],
                                                         priority=pb.PRIORITY_BULK))
                bulk_tokens.append((time.perf_counter(), reply.usage.prompt_tokens))

        senders = [asyncio.create_task(bulk_sender()) for _ in range(24)]
        await asyncio.sleep(2.0)  # let the backlog build
        t0 = time.perf_counter()
        tasks = []
        i = 0
        while time.perf_counter() - t0 < load_s:
            tasks.append(asyncio.create_task(query(queries[i % len(queries)])))
            i += 1
            await asyncio.sleep(0.25)
        loaded = await asyncio.gather(*tasks)
        t1 = time.perf_counter()
        stop.set()
        await asyncio.gather(*senders)
    window = [n for t, n in bulk_tokens if t0 <= t <= t1]
    return {"bulk_batch_tokens": cap, "batch_tokens": batch_tokens, "idle": pct(idle),
            "one_bulk_batch_ms": round(float(np.median(batch)), 1), "loaded": pct(loaded),
            "bulk_tokens_per_s": round(sum(window) / (t1 - t0))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", default="0,2048,512", help="--bulk-batch-tokens values to run")
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--load-seconds", type=float, default=12.0)
    # One torch thread by default: on a small shared machine a busy neighbour process stalls
    # two OpenMP threads at every barrier, and the figures then swing by tens of times.
    parser.add_argument("--worker-threads", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "load" / "results"))
    args = parser.parse_args()

    import torch

    queries = sorted({a.split(".")[0] for a, _, _ in stsb_pairs()})[:200]
    runs = []
    for cap in (int(c) for c in args.caps.split(",")):
        srv = ServerProcess("--log-level", "WARNING", "--bulk-batch-tokens", str(cap), "--worker-threads",
                            str(args.worker_threads), "--max-batch-tokens", str(args.max_batch_tokens)).start(timeout=60)
        try:
            runs.append(asyncio.run(measure(srv.listen, cap, args.max_batch_tokens, queries, args.load_seconds)))
        finally:
            srv.terminate()
        print(runs[-1], flush=True)

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "device": machine(),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "grpcio": grpc.__version__, "pollen": rev},
              "model": "all-MiniLM-L6-v2", "max_batch_tokens": args.max_batch_tokens,
              "worker_threads": args.worker_threads, "runs": runs}
    lines = ["| --bulk-batch-tokens | one bulk batch | idle p50 / p99 | under bulk load p50 / p99 | "
             "idle p50 + one batch | bulk tokens/s |", "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        label = f"{r['bulk_batch_tokens']} (= {r['batch_tokens']})" if r["bulk_batch_tokens"] == 0 else str(r["batch_tokens"])
        bound = r["idle"]["p50_ms"] + r["one_bulk_batch_ms"]
        lines.append(f"| {label} | {r['one_bulk_batch_ms']} ms | {r['idle']['p50_ms']} / {r['idle']['p99_ms']} ms | "
                     f"{r['loaded']['p50_ms']} / {r['loaded']['p99_ms']} ms | {bound:.1f} ms | {r['bulk_tokens_per_s']} |")
    table = "\n".join(lines)
    header = (f"# Priority lanes on the CPU, {result['date']}\n\n{result['device']}; python "
              f"{result['versions']['python']}, torch {torch.__version__}, grpcio {grpc.__version__}, pollen {rev}; "
              f"model {result['model']}, --max-batch-tokens {args.max_batch_tokens}, --worker-threads {args.worker_threads}.\n"
              "Command: `python load/bench_priority.py` (client and server on the same machine). Bulk: 24 senders "
              f"of 4 x {SEQ_TOKENS}-token requests; interactive: one short STS-B sentence every 0.25 s.\n\n")
    print(table)
    write_results(args.out, f"priority-cpu-{result['date']}", result, header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
