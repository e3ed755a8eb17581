"""Programmatic dependent launch for the query layer (worker/kernels/skinny.py), A/B in one process.

    python load/bench_pdl.py --shape qwen3-0.6b --out load/results/gpu-pdl-DATE [--rounds 2]

Alternates the modes (off, early: the next kernel launches once this one has waited, late: once
this one's main loop is done) over `rounds` rounds on one random-weight checkpoint, and per mode
times:
  engine   one query of 8..32 tokens at a time through CudaEngine with graphs (submit -> result),
           p50 / p99 ms, as bench_engine.py's query row
  replay   the captured 16- and 32-token graphs replayed back to back, µs a replay (GPU time
           alone: CUDA events around 50 replays)
and checks each mode's rows against the mode-off rows (cosine). Needs a GPU of sm_90 or later.
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
from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.worker.cuda_engine import CudaEngine  # noqa: E402
from pollen.worker.engine import INTERACTIVE  # noqa: E402
from pollen.worker.kernels import short_attention, skinny  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402

MODES = {"off": skinny.PDL_OFF, "early": skinny.PDL_EARLY, "late": skinny.PDL_LATE}


def engine_for(path: str, mode: int) -> CudaEngine:
    model = load_model(path, device="cuda", dtype=torch.bfloat16, options=EngineOptions(pdl=False))
    # The loader's choice is on/off; the late trigger is reachable only by hand, for this comparison.
    model.ops = dataclasses.replace(
        model.ops, skinny_linear=functools.partial(skinny.skinny_linear, pdl=mode),
        short_qk_rope_attention=functools.partial(short_attention.short_qk_rope_attention, pdl=mode))
    if model.short_qk_rope_attention is not None:
        model.short_qk_rope_attention = model.ops.short_qk_rope_attention
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
    if not skinny.pdl_supported():
        sys.exit("PDL needs Triton's gdc instructions and a GPU of sm_90 or later")
    path = make_checkpoint(args.shape, args.root)
    vocab = SHAPES[args.shape]["vocab_size"]
    q = queries(args.queries + 20, vocab)
    check = [pack([s]) for s in q[:16]] + [pack(q[16:20])]
    reference = None
    runs = []
    for r in range(args.rounds):
        for name, mode in MODES.items():
            engine = engine_for(path, mode)
            rows = np.concatenate([engine.submit(b).result().copy() for b in check])
            if reference is None:
                reference = rows
            a, b = torch.as_tensor(rows, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
            run = {"round": r, "mode": name, "min_cos_vs_off": torch.cosine_similarity(a, b, dim=1).min().item(),
                   "engine": latency(lambda s, e=engine: e.submit(pack([s])).result(), q),
                   "replay_16_us": replay_us(engine, 16, vocab), "replay_32_us": replay_us(engine, 32, vocab)}
            runs.append(run)
            log(run)
            del engine
            torch.cuda.empty_cache()
    meta = versions()
    meta["date"] = datetime.date.today().isoformat()
    lines = ["| round | mode | engine p50 ms | engine p99 ms | 16-token replay µs | 32-token replay µs | min cos vs off |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        lines.append(f"| {run['round']} | {run['mode']} | {run['engine']['p50_ms']:.3f} | {run['engine']['p99_ms']:.3f} "
                     f"| {run['replay_16_us']:.1f} | {run['replay_32_us']:.1f} | {run['min_cos_vs_off']:.6f} |")
    header = (f"# Programmatic dependent launch in the query layer, {meta['date']}\n\n{meta.get('gpu', '')} "
              f"torch {torch.__version__}. {args.shape}, random weights, bf16, graphs. Command: "
              f"`python load/bench_pdl.py --shape {args.shape} --rounds {args.rounds} --out {args.out}`.\n\n")
    write_results_to(args.out, {"meta": meta, "runs": runs}, header, "\n".join(lines))
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()
