"""Microbenchmark: the skinny Triton matrix product vs torch (cuBLAS) at query sizes, timed inside
CUDA graphs (20 launches back to back, as in the model's graph), for the Qwen3-0.6B layer shapes.

    python load/bench_skinny.py
"""
from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from worker.kernels.skinny_gemm import skinny_linear  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def graph_time(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (10 * reps)


def main():
    results = {}
    for m in (16, 32):
        for name, (n, k) in SHAPES.items():
            # 28 distinct weights, like the layers: the weights must come from memory, not L2.
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(28)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            it = itertools.cycle(ws)
            torch_us = graph_time(lambda: F.linear(x, next(it)), reps=28)
            ref = F.linear(x, ws[0]).float()
            best = None
            for bn, bk, st in itertools.product((16, 32), (128, 256), (3, 5)):
                try:
                    out = skinny_linear(x, ws[0], block_n=bn, block_k=bk, stages=st).float()
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    us = graph_time(lambda: skinny_linear(x, next(it), block_n=bn, block_k=bk, stages=st), reps=28)
                except Exception as exc:  # a config that does not compile is just skipped
                    print(m, name, bn, bk, st, "failed", repr(exc)[:100])
                    continue
                if best is None or us < best[0]:
                    best = (us, bn, bk, st, err)
            results[f"{name}_m{m}"] = {"torch_us": torch_us, "triton_us": best[0], "config": best[1:4], "rel_err": best[4],
                                       "weight_MB": n * k * 2 / 1e6}
            print(m, name, json.dumps(results[f"{name}_m{m}"]), flush=True)
    return results


if __name__ == "__main__":
    main()
