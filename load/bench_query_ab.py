"""The query products' epilogue inputs read before or after their main loop (worker/kernels/skinny.py,
EARLY), A/B in one process.

    python load/bench_query_ab.py --shape qwen3-0.6b --out load/results/gpu-query-ab-DATE [--rounds 2]

Alternates the two over `rounds` rounds on one random-weight checkpoint, each on a fresh engine
with graphs, and per path times:
  engine   one query of 8..32 tokens at a time through CudaEngine on the interactive lane
           (submit -> result), p50 / p99 ms, as bench_engine.py's query row
  replay   the captured 16- and 32-token graphs replayed back to back, µs a replay (GPU time
           alone: CUDA events around 50 replays)
and checks each path's rows against the first path's (cosine) and itself on a second pass (bits).
Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from load.bench_engine import latency, log, queries, versions  # noqa: E402
from load.gpu_models import SHAPES, make_checkpoint  # noqa: E402
from load.results_file import write_results_to  # noqa: E402
from pollen.worker.cuda_engine import INTERACTIVE, CudaEngine  # noqa: E402
from pollen.worker.kernels import skinny  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402

PATHS = {"late loads": False, "early loads": True}  # name: skinny_linear's early_loads


def engine_for(path: str, early_loads: bool) -> CudaEngine:
    model = load_model(path, device="cuda", dtype=torch.bfloat16)
    model.ops = dataclasses.replace(model.ops, skinny_linear=functools.partial(skinny.skinny_linear,
                                                                               early_loads=early_loads))
    engine = CudaEngine(model, "cuda", max_batch_tokens=4096, cuda_graphs=True)
    engine.warm_up()
    return engine


def replay_us(engine: CudaEngine, tokens: int, vocab: int) -> float:
    batch = pack([np.random.default_rng(tokens).integers(0, vocab, tokens, dtype=np.int32)])
    engine.submit(batch).result()  # captures the bucket
    shape = engine.bucket(batch)
    graph = engine.graphs[shape][0]
    stream = engine.lanes[INTERACTIVE].stream
    with torch.cuda.stream(stream):
        for _ in range(5):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / 50


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    p.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--queries", type=int, default=300)
    args = p.parse_args()
    path = make_checkpoint(args.shape, args.root)
    vocab = SHAPES[args.shape]["vocab_size"]
    q = queries(args.queries + 20, vocab)
    check = [pack([s]) for s in q[:16]] + [pack(q[16:18])]
    reference = None
    runs = []
    for r in range(args.rounds):
        for name, early in PATHS.items():
            engine = engine_for(path, early)
            rows = np.concatenate([engine.submit(b).result().copy() for b in check])
            again = np.concatenate([engine.submit(b).result().copy() for b in check])
            if reference is None:
                reference = rows
            a, b = torch.as_tensor(rows, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
            run = {"round": r, "path": name, "min_cos_vs_first": torch.cosine_similarity(a, b, dim=1).min().item(),
                   "same_bits_again": bool(np.array_equal(rows, again)),
                   "engine": latency(lambda s, e=engine: e.submit(pack([s])).result(), q),
                   "replay_16_us": replay_us(engine, 16, vocab), "replay_32_us": replay_us(engine, 32, vocab)}
            runs.append(run)
            log(run)
            del engine
            torch.cuda.empty_cache()
    meta = versions()
    meta["date"] = datetime.date.today().isoformat()
    lines = ["| round | path | engine p50 ms | engine p99 ms | 16-token replay µs | 32-token replay µs "
             "| min cos vs the first path | same bits twice |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for run in runs:
        lines.append(f"| {run['round']} | {run['path']} | {run['engine']['p50_ms']:.3f} | {run['engine']['p99_ms']:.3f} "
                     f"| {run['replay_16_us']:.1f} | {run['replay_32_us']:.1f} | {run['min_cos_vs_first']:.6f} "
                     f"| {run['same_bits_again']} |")
    header = (f"# The query products' epilogue inputs read after or before the main loop, {meta['date']}\n\n"
              f"{meta.get('gpu', '')} torch {torch.__version__}. {args.shape}, random weights, bf16, graphs. Command: "
              f"`python load/bench_query_ab.py --shape {args.shape} --rounds {args.rounds} --out {args.out}`.\n\n")
    write_results_to(args.out, {"meta": meta, "runs": runs}, header, "\n".join(lines))
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()
