"""Bulk batches in a share of the GPU's SMs: what a query gains and what bulk loses, on the real engine.

    python load/bench_lane_partition.py --shape qwen3-0.6b [--configs 0:0,124:0,116:16] [--out load/results/STEM]

The engine (worker/cuda_engine.py) runs the two lanes on streams of two priorities; a query's
kernels still wait for bulk blocks to leave SMs. Here the bulk lane's streams come from a CUDA
green context of SMS SMs instead (`torch.cuda.green_contexts`), its graphs captured again there,
with cuBLAS told to size its grids for the SMs the partition leaves (`torch._C.
_set_sm_carveout_experimental(CARVEOUT)`, set while the bulk graphs are captured only). The
interactive lane keeps every SM. Config SMS:CARVEOUT, SMS 0 = the engine as it is.

One thread drives the engine as the worker's loop does (worker/loop.py): two bulk batches of
documents in flight (8,192-token budget, log-normal lengths, median about 200 tokens, up to
2,048), and a query batch of QUERIES texts of 8 to 32 tokens submitted GAP_MS after the previous
one is done (the rest of a query's path in the server, so a closed-loop client). For each
config: bulk tokens/s alone, the query batches' latency alone and beside bulk (submit to result,
p50 / p99), and bulk tokens/s beside them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.bench_engine import docs, greedy_batches, queries  # noqa: E402
from load.gpu_models import make_checkpoint  # noqa: E402
from load.results_file import write_results_to  # noqa: E402
from pollen.worker.cuda_engine import CudaEngine  # noqa: E402
from pollen.worker.engine import BULK, INTERACTIVE  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402
from pollen.worker.sm_partition import BulkPartition  # noqa: E402

BUDGET = 8192


def drive(engine, bulk: list, asks: list, seconds: float, gap_s: float) -> dict:
    """The worker's pattern for `seconds`: up to two bulk batches in flight (none if `bulk` is
    empty), one query batch at a time `gap_s` after the last answer (none if `asks` is empty)."""
    running: deque = deque()
    tokens, latencies, query, next_query, i, j = 0, [], None, 0.0, 0, 0
    now = time.perf_counter
    end = now() + seconds
    while now() < end:
        while bulk and len(running) < 2:
            batch = bulk[i % len(bulk)]
            running.append((batch.tokens, engine.submit(batch, lane=BULK)))
            i += 1
        if asks and query is None and now() >= next_query:
            query = (now(), engine.submit(asks[j % len(asks)], lane=INTERACTIVE))
            j += 1
        if query is not None and query[1].done():
            query[1].result()
            latencies.append(now() - query[0])
            query, next_query = None, now() + gap_s
        if running and running[0][1].done():
            n, pending = running.popleft()
            pending.result()
            tokens += n
    for _, pending in running:
        pending.result()
    ms = np.array(latencies) * 1e3
    return {"bulk_tokens_per_s": tokens / seconds,
            "query_p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
            "query_p99_ms": float(np.percentile(ms, 99)) if len(ms) else None, "queries": len(ms)}


def partition(engine: CudaEngine, sms: int, carveout: int) -> None:
    """The bulk lane on a green context of `sms` SMs (0: a plain stream), its graphs dropped so
    that they are captured again there, under cuBLAS carveout `carveout`. The engine's own
    partition (worker/sm_partition.py, `bulk_sms`), swapped in after construction so that one
    engine and one warm-up serve every config."""
    lane = engine.lanes[BULK]
    torch.cuda.synchronize()
    if sms:
        lane.partition = BulkPartition(engine.device, sms)
        lane.stream, lane.copy_stream = lane.partition.stream(), lane.partition.stream()
    else:
        low = torch.cuda.Stream.priority_range()[0]
        lane.partition = None
        lane.stream = torch.cuda.Stream(engine.device, priority=low)
        lane.copy_stream = torch.cuda.Stream(engine.device, priority=low)
    engine.bulk_sms = sms
    lane.graphs.clear()
    lane.pool = torch.cuda.graph_pool_handle()
    torch._C._set_sm_carveout_experimental(carveout or None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    p.add_argument("--configs", default="0:0,128:0,124:8,116:0,116:16,100:32")
    p.add_argument("--queries", type=int, default=1, help="texts in each query batch")
    p.add_argument("--gap-ms", type=float, default=1.2)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    path = make_checkpoint(args.shape, args.root)
    engine = CudaEngine(load_model(path, device="cuda", dtype=torch.bfloat16), "cuda", max_batch_tokens=BUDGET,
                        graph_max_tokens=BUDGET)
    engine.warm_up(budget_s=60)
    vocab = engine.model.spec.vocab_size
    bulk = [pack(b) for b in greedy_batches(docs(6000, vocab, 2048), BUDGET)][:40]
    qs = queries(64 * args.queries, vocab)
    asks = [pack(qs[k:k + args.queries]) for k in range(0, len(qs), args.queries)]
    alone = drive(engine, [], asks, args.seconds / 2, args.gap_ms / 1e3)
    print("queries alone", alone, flush=True)
    rows = []
    for config in args.configs.split(","):
        sms, carveout = map(int, config.split(":"))
        partition(engine, sms, carveout)
        try:
            for batch in bulk:  # captures the bulk buckets under this partition
                engine.submit(batch, lane=BULK).result()
            torch._C._set_sm_carveout_experimental(None)
            row = {"sms": sms, "carveout": carveout, "bulk_alone": drive(engine, bulk, [], args.seconds, 0),
                   "mixed": drive(engine, bulk, asks, args.seconds, args.gap_ms / 1e3)}
        except Exception as exc:  # a partition the driver refuses: say so and go on
            row = {"sms": sms, "carveout": carveout, "error": repr(exc)[:300]}
        rows.append(row)
        print(row, flush=True)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    head = (f"# Bulk batches in a share of the SMs, real engine, {time.strftime('%Y-%m-%d')}\n\n"
            f"{torch.cuda.get_device_name()} ({sm_count} SMs), torch {torch.__version__}; the {args.shape} shape, "
            f"bf16, random weights. Command: `python load/bench_lane_partition.py --shape {args.shape} --configs "
            f"{args.configs} --queries {args.queries} --gap-ms {args.gap_ms} --seconds {args.seconds}`. Query "
            f"batches of {args.queries} text(s) alone: p50 {alone['query_p50_ms']:.2f} / p99 "
            f"{alone['query_p99_ms']:.2f} ms.\n\n")
    table = ("| bulk lane on | cuBLAS carveout | bulk tokens/s alone | bulk tokens/s beside queries | "
             "query p50 / p99 ms beside bulk |\n| --- | --- | --- | --- | --- |\n")
    for r in rows:
        where = "all SMs (a stream)" if not r["sms"] else f"{r['sms']} SMs (green context)"
        if "error" in r:
            table += f"| {where} | {r['carveout'] or 'none'} | {r['error']} | | |\n"
            continue
        m = r["mixed"]
        table += (f"| {where} | {r['carveout'] or 'none'} | {r['bulk_alone']['bulk_tokens_per_s']:,.0f} | "
                  f"{m['bulk_tokens_per_s']:,.0f} | {m['query_p50_ms']:.2f} / {m['query_p99_ms']:.2f} |\n")
    print(head + table)
    if args.out:
        write_results_to(args.out, {"alone": alone, "rows": rows}, head, table)


if __name__ == "__main__":
    main()
