"""Microbenchmark: the skinny kernels (worker/kernels/skinny.py) against what they replace,
at query sizes, timed inside CUDA graphs with a distinct weight per launch (as the layers have).

    python load/bench_skinny_linear.py --out load/results/gpu-skinny-linear-DATE

For each product of a Qwen3 layer (0.6B and 4B shapes) it times:
  separate  the kernels the engine ran before: add+RMSNorm, cuBLAS product (and SiLU-gate)
  skinny    our one kernel, at each tile configuration, without and with PDL
and writes the best configuration per (swiglu, K) as the table CONFIGS wants (PREFIX.json,
PREFIX.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from load.results_file import write_results  # noqa: E402
from worker import kernels  # noqa: E402
from worker.kernels import skinny as sk  # noqa: E402

# name: (K, N, swiglu, norm) per shape; for swiglu N is the intermediate size.
SHAPES = {
    "qwen3-0.6b": {"qkv": (1024, 4096, False, True), "o": (2048, 1024, False, False),
                   "gate_up": (1024, 3072, True, True), "down": (3072, 1024, False, False)},
    "qwen3-4b": {"qkv": (2560, 6144, False, True), "o": (4096, 2560, False, False),
                 "gate_up": (2560, 9728, True, True), "down": (9728, 2560, False, False)},
}
LAYERS = 28
GRID = list(itertools.product((16, 32), (128, 256), (4, 8), (3, 4)))  # BLOCK_N, BLOCK_K, warps, stages


def graph_us(fns) -> float:
    """Mean time per call of fns (one call each, back to back) replayed as one CUDA graph."""
    for fn in fns[:2]:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (20 * len(fns))


def bench_op(m, k, n, swiglu, norm):
    dt = torch.bfloat16
    rows = 2 * n if swiglu else n
    weights = [torch.randn(rows, k, device="cuda", dtype=dt) * 0.02 for _ in range(LAYERS)]
    h, r = (torch.randn(m, k, device="cuda", dtype=dt) for _ in range(2))
    gamma = torch.ones(k, device="cuda", dtype=dt)

    def separate(w):
        x = kernels.add_rms_norm(h, r, gamma, 1e-6)[0] if norm else h
        y = F.linear(x, w)
        return kernels.silu_mul(y) if swiglu else y

    def ours(w, config, pdl):
        extra = dict(residual=r, norm_weight=gamma, eps=1e-6) if norm else {}
        return sk.skinny_linear(h, w, swiglu=swiglu, config=config, pdl=pdl, **extra)[0]

    result = {"separate_us": graph_us([lambda w=w: separate(w) for w in weights])}
    ref = separate(weights[0]).float()
    best = None
    for config in GRID:
        if n % config[0] or k % config[1]:
            continue
        try:
            err = ((ours(weights[0], config, False).float() - ref).abs().max() / ref.abs().max()).item()
            us = graph_us([lambda w=w: ours(w, config, False) for w in weights])
        except Exception as exc:  # a configuration that does not compile (registers, shared memory)
            print(f"  {config} failed: {repr(exc)[:120]}", flush=True)
            continue
        if best is None or us < best["us"]:
            best = {"us": us, "config": config, "rel_err": err}
    result["skinny"] = best
    if sk.pdl_on():
        try:
            result["skinny_pdl_us"] = graph_us([lambda w=w: ours(w, best["config"], True) for w in weights])
        except Exception as exc:
            result["skinny_pdl_error"] = repr(exc)[:300]
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    p.add_argument("--rows", default="16,64")
    args = p.parse_args()
    results = {}
    for shape, ops in SHAPES.items():
        for m in map(int, args.rows.split(",")):
            for name, (k, n, swiglu, norm) in ops.items():
                r = bench_op(m, k, n, swiglu, norm)
                results[f"{shape} {name} m={m}"] = r
                print(shape, name, m, json.dumps(r), flush=True)
    # Best configuration per (swiglu, K) at 16 rows, the query bucket.
    configs = {f"{'swiglu' if swiglu else 'plain'},{k}": results[f"{shape} {name} m=16"]["skinny"]["config"]
               for shape, ops in SHAPES.items() for name, (k, n, swiglu, norm) in ops.items()
               if f"{shape} {name} m=16" in results}
    lines = ["| product | rows | separate kernels (µs) | skinny (µs) | skinny + PDL (µs) | config (BN, BK, warps, stages) |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for key, r in results.items():
        shape_name, m = key.rsplit(" m=", 1)
        pdl = f"{r['skinny_pdl_us']:.2f}" if "skinny_pdl_us" in r else "n/a"
        lines.append(f"| {shape_name} | {m} | {r['separate_us']:.2f} | {r['skinny']['us']:.2f} | {pdl} "
                     f"| {tuple(r['skinny']['config'])} |")
    import datetime

    import triton

    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__}
    header = (f"# Skinny products at query sizes, {meta['date']}\n\n{meta['gpu']}, torch {meta['torch']}, "
              f"triton {meta['triton']}. Mean µs per product inside a CUDA graph of {LAYERS} products with "
              f"distinct weights. Command: `python load/bench_skinny_linear.py --out {args.out}`.\n\n")
    write_results(os.path.dirname(args.out) or ".", os.path.basename(args.out),
                  {"meta": meta, "results": results, "configs": configs}, header, "\n".join(lines))


if __name__ == "__main__":
    main()
