"""The persistent query layer (worker/kernels/query_layer.py) against five launches a layer, A/B in
one process.

    python load/bench_query_layer.py --shape qwen3-0.6b --out load/results/gpu-query-layer-DATE [--rounds 2]

Alternates the two paths (EngineOptions.persistent_layers off / on) over `rounds` rounds on one
random-weight checkpoint, and per path times:
  engine   one query of 8..32 tokens at a time through CudaEngine with graphs on the interactive
           lane (submit -> result), p50 / p99 ms, as bench_engine.py's query row
  replay   the captured 16- and 32-token graphs replayed back to back, µs a replay (GPU time
           alone: CUDA events around 50 replays)
and checks each path's rows against the five-launch rows (cosine). Then, for the persistent
layer in a 16-token graph, variants (prefetch off, 8 warps) and where a layer's time goes: each
program stamps the GPU clock at its phase boundaries (worker/kernels/query_layer.py, TIMELINE), and
the table gives, per phase, the median and the slowest program's end of work and of the barrier
after it, µs from the layer's start (mean over the middle layers). Needs a CUDA GPU.
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
from pollen.worker.cuda_engine import INTERACTIVE, CudaEngine  # noqa: E402
from pollen.worker.kernels import query_layer  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402

PATHS = {"five launches": False, "persistent": True}


def engine_for(path: str, persistent: bool, layer=None, scratch=None) -> CudaEngine:
    model = load_model(path, device="cuda", dtype=torch.bfloat16,
                       options=EngineOptions(persistent_layers=persistent))
    if layer is not None:
        model.ops = dataclasses.replace(model.ops, query_layer=layer)
    if scratch is not None:
        model.ops = dataclasses.replace(model.ops, query_layer_scratch=scratch)
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


PHASES = ["qkv", "attention", "o", "gate/up", "down"]


class Stamped:
    """query_layer with a timeline: the i-th call of a forward fills timeline[i % layers]."""

    def __init__(self, layers: int, programs: int, **variant):
        self.timeline = torch.zeros(layers, programs, query_layer.STAMPS.value, dtype=torch.int64, device="cuda")
        self.calls, self.variant = 0, variant

    def __call__(self, *args, **kwargs):
        row = self.timeline[self.calls % self.timeline.shape[0]]
        self.calls += 1
        return query_layer.query_layer(*args, **kwargs, timeline=row, **self.variant)


def phase_profile(timeline: torch.Tensor) -> dict:
    """µs from each layer's first program start: per phase, (median, slowest) end of work and of the
    barrier after it, means over the middle layers; and the gap between one layer's last program
    out and the next one's first program in."""
    timeline = timeline[:, timeline[0, :, 0] != 0]  # programs that ran (a variant may fall back to fewer)
    t = timeline.double() / 1000
    start = t[:, :, 0].min(dim=1).values[:, None]
    rel = t - start[:, :, None]
    middle = rel[1:-1]
    out = {}
    for i, name in enumerate(PHASES):
        work = middle[:, :, 2 * i + 1]
        after = middle[:, :, 2 * i + 2]
        out[name] = {"work_median": work.median(dim=1).values.mean().item(), "work_max": work.max(dim=1).values.mean().item(),
                     "done_median": after.median(dim=1).values.mean().item(),
                     "done_max": after.max(dim=1).values.mean().item()}
    gaps = t[1:, :, 0].min(dim=1).values - t[:-1, :, 10].max(dim=1).values
    out["layer_us"] = (rel[1:-1, :, 10].max(dim=1).values).mean().item()
    out["gap_us"] = gaps.mean().item()
    return out


# Tiles for two programs an SM: about 2 items a phase for each SM's pair (BLOCK_N, BLOCK_K, warps, stages, split).
HALF_TILES = {"qkv": (16, 256, 4, 4, 1), "o": (32, 128, 4, 4, 8), "gu": (16, 128, 4, 4, 1), "down": (32, 128, 4, 4, 8)}
VARIANTS = {
    "prefetch, 1 program an SM": ({}, {}),
    "no prefetch, 1 program an SM": ({"prefetch": False}, {}),
    "no prefetch, 2 programs an SM": ({"prefetch": False}, {"configs": HALF_TILES, "ctas_per_sm": 2}),
    "prefetch, 2 programs an SM": ({}, {"configs": HALF_TILES, "ctas_per_sm": 2}),
}


def phases(path: str, vocab: int, layers: int) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, first = [], None
    for name, (variant, tiling) in VARIANTS.items():
        scratch = functools.partial(query_layer.Scratch, **tiling)
        plain = engine_for(path, True, functools.partial(query_layer.query_layer, **variant), scratch)
        replay = replay_us(plain, 16, vocab)
        check = pack([np.random.default_rng(5).integers(0, vocab, n, dtype=np.int32) for n in (5, 9)])
        got = torch.as_tensor(plain.submit(check).result().copy(), dtype=torch.float64)
        first = got if not rows else first
        same = torch.cosine_similarity(got, first, dim=1).min().item()
        del plain
        stamped = Stamped(layers, sms * tiling.get("ctas_per_sm", 1), **variant)
        engine = engine_for(path, True, stamped, scratch)
        stamped_replay = replay_us(engine, 16, vocab)  # the last replay leaves its stamps
        torch.cuda.synchronize()
        rows.append({"variant": name, "replay_16_us": replay, "replay_16_stamped_us": stamped_replay,
                     "min_cos_vs_first_variant": same,
                     "profile": phase_profile(stamped.timeline.cpu())})
        log(rows[-1])
        del engine
        torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    p.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--phases-only", action="store_true", help="skip the A/B rounds")
    args = p.parse_args()
    path = make_checkpoint(args.shape, args.root)
    vocab = SHAPES[args.shape]["vocab_size"]
    q = queries(args.queries + 20, vocab)
    check = [pack([s]) for s in q[:16]] + [pack(q[16:18])]
    reference = None
    runs = []
    for r in range(0 if args.phases_only else args.rounds):
        for name, persistent in PATHS.items():
            engine = engine_for(path, persistent)
            rows = np.concatenate([engine.submit(b).result().copy() for b in check])
            again = np.concatenate([engine.submit(b).result().copy() for b in check])
            if reference is None:
                reference = rows
            a, b = torch.as_tensor(rows, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
            run = {"round": r, "path": name, "min_cos_vs_five": torch.cosine_similarity(a, b, dim=1).min().item(),
                   "same_bits_again": bool(np.array_equal(rows, again)),
                   "engine": latency(lambda s, e=engine: e.submit(pack([s])).result(), q),
                   "replay_16_us": replay_us(engine, 16, vocab), "replay_32_us": replay_us(engine, 32, vocab)}
            runs.append(run)
            log(run)
            del engine
            torch.cuda.empty_cache()
    profiles = phases(path, vocab, SHAPES[args.shape]["num_hidden_layers"])
    meta = versions()
    meta["date"] = datetime.date.today().isoformat()
    lines = ["| round | path | engine p50 ms | engine p99 ms | 16-token replay µs | 32-token replay µs "
             "| min cos vs five launches | same bits twice |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for run in runs:
        lines.append(f"| {run['round']} | {run['path']} | {run['engine']['p50_ms']:.3f} | {run['engine']['p99_ms']:.3f} "
                     f"| {run['replay_16_us']:.1f} | {run['replay_32_us']:.1f} | {run['min_cos_vs_five']:.6f} "
                     f"| {run['same_bits_again']} |")
    lines += ["", "Where a persistent layer's time goes (16-token graph; µs from the layer's start, mean of the "
              "middle layers; median program / slowest program):", "",
              "| variant | replay µs | phase | work done | barrier passed |", "| --- | ---: | --- | ---: | ---: |"]
    for row in profiles:
        prof = row["profile"]
        for name in PHASES:
            ph = prof[name]
            lines.append(f"| {row['variant']} | {row['replay_16_us']:.1f} | {name} | {ph['work_median']:.2f} / "
                         f"{ph['work_max']:.2f} | {ph['done_median']:.2f} / {ph['done_max']:.2f} |")
        lines.append(f"| {row['variant']} | | layer, gap to the next | {prof['layer_us']:.2f} | {prof['gap_us']:.2f} |")
    header = (f"# The persistent query layer against five launches a layer, {meta['date']}\n\n{meta.get('gpu', '')} "
              f"torch {torch.__version__}. {args.shape}, random weights, bf16, graphs. Command: "
              f"`python load/bench_query_layer.py --shape {args.shape} --rounds {args.rounds} --out {args.out}`.\n\n")
    write_results_to(args.out, {"meta": meta, "runs": runs, "phases": profiles}, header, "\n".join(lines))
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()
