"""A kernel tuning tool, not a serving benchmark: the skinny kernels (worker/kernels/skinny.py)
against the kernels they replace, at query sizes, timed inside CUDA graphs with distinct weights per
layer (as in the model); it picks the best tile configuration of each product on this GPU.

    python -m pollen.worker.kernels.tune_skinny [--configs TABLE.json]

For the products of a Qwen3 layer (0.6B and 4B shapes) it times
  separate  the unfused kernels: add+RMSNorm, cuBLAS product (and SiLU-gate)
  skinny    our one kernel, at each tile configuration (the best is kept)
and then a whole layer without its attention: the 7 separate kernels against the 4 skinny ones.
It prints both tables and, with --configs, writes the best configuration per product as a JSON
table that EngineOptions.skinny_configs (--skinny-configs) takes: for a GPU other than the one
worker/kernels/skinny_configs.py was measured on.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from pollen.worker.kernels import activations, norms
from pollen.worker.kernels import skinny as sk

ALL_SHAPES = {"qwen3-0.6b": (1024, 4096, 2048, 3072), "qwen3-4b": (2560, 6144, 4096, 9728)}  # hidden, qkv, attn, inter
LAYERS = 28
GRID = [c + (1,) for c in itertools.product((16, 32), (128, 256), (4,), (3, 4))] + [(16, 512, 4, 2, 1),
                                                                                 (64, 128, 4, 3, 1)]
# The o and down products have few output columns for their K: split K among programs as well.
SPLIT_GRID = [c for c in itertools.product((16, 32), (128,), (4,), (4,), (2, 4, 8))] + [
    (16, 256, 4, 4, 2), (16, 256, 4, 4, 4), (32, 256, 4, 3, 2)]
DT = torch.bfloat16


def graph_us(fns, per=1) -> float:
    """Mean time per call of fns (back to back) replayed as one CUDA graph, divided by per."""
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
    return start.elapsed_time(end) * 1000 / (20 * len(fns) * per)


class Layer:
    def __init__(self, hidden, qkv, attn, inter):
        w = lambda n, k: torch.randn(n, k, device="cuda", dtype=DT) * 0.02  # noqa: E731
        self.qkv, self.o = w(qkv, hidden), w(hidden, attn)
        self.gate_up, self.down = w(2 * inter, hidden), w(hidden, inter)
        self.g = torch.ones(hidden, device="cuda", dtype=DT)


def products(m, shape):
    """name -> (kind, K, N, separate(layer), skinny(layer, config)) over shared inputs."""
    hidden, qkv, attn, inter = shape
    h, r = (torch.randn(m, hidden, device="cuda", dtype=DT) for _ in range(2))
    a, act = torch.randn(m, attn, device="cuda", dtype=DT), torch.randn(m, inter, device="cuda", dtype=DT)
    _, parts = sk.skinny_linear(a, Layer(*shape).o, residual=r)
    return {
        "qkv": ("norm", hidden, qkv, lambda L: F.linear(norms.add_rms_norm(h, r, L.g, 1e-6)[0], L.qkv),
                lambda L, c: sk.skinny_linear(r, L.qkv, parts=parts, eps=1e-6, config=c)),
        "o": ("residual", attn, hidden, lambda L: F.linear(a, L.o),
              lambda L, c: sk.skinny_linear(a, L.o, residual=r, config=c)),
        "gate_up": ("swiglu", hidden, inter,
                    lambda L: activations.silu_mul(F.linear(norms.add_rms_norm(h, r, L.g, 1e-6)[0], L.gate_up)),
                    lambda L, c: sk.skinny_linear(r, L.gate_up, parts=parts, eps=1e-6, swiglu=True, config=c)),
        "down": ("residual", inter, hidden, lambda L: F.linear(act, L.down),
                 lambda L, c: sk.skinny_linear(act, L.down, residual=r, config=c)),
    }


def layer_chain(m, shape, layers):
    """One layer without attention, both ways, chained through the residual as in the model."""
    hidden, _, attn, _ = shape
    a = torch.randn(m, attn, device="cuda", dtype=DT)
    state = {"r": torch.randn(m, hidden, device="cuda", dtype=DT)}

    def separate(L):
        x, r = norms.add_rms_norm(state["r"], None, L.g, 1e-6)
        F.linear(x, L.qkv)
        x, r = norms.add_rms_norm(F.linear(a, L.o), r, L.g, 1e-6)
        state["r"] = F.linear(activations.silu_mul(F.linear(x, L.gate_up)), L.down) + r

    def skinny(L):
        r, parts = sk.skinny_linear(a, L.o, residual=state["r"])
        sk.skinny_linear(r, L.qkv, parts=parts, eps=1e-6)
        act = sk.skinny_linear(r, L.gate_up, parts=parts, eps=1e-6, swiglu=True)
        state["r"] = sk.skinny_linear(act, L.down, residual=r)[0]

    return {"separate_us": graph_us([lambda L=L: separate(L) for L in layers]),
            "skinny_us": graph_us([lambda L=L: skinny(L) for L in layers])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default=None, help="also write the tile table here, for EngineOptions.skinny_configs")
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b")
    p.add_argument("--rows", default="16,32,64", help="row counts (the graph buckets of one query)")
    args = p.parse_args()
    results, configs, chains = {}, {}, {}
    for shape_name in args.shapes.split(","):
        shape = ALL_SHAPES[shape_name]
        layers = [Layer(*shape) for _ in range(LAYERS)]
        for m in map(int, args.rows.split(",")):
            for name, (kind, k, n, separate, skinny) in products(m, shape).items():
                r = {"separate_us": graph_us([lambda L=L: separate(L) for L in layers])}
                for config in GRID + (SPLIT_GRID if kind == "residual" else []):
                    if n % config[0] or k % (config[1] * config[4]):
                        continue
                    try:
                        us = graph_us([lambda L=L: skinny(L, config) for L in layers])
                    except Exception as exc:  # a configuration that does not compile
                        print(f"  {name} {config} failed: {repr(exc)[:120]}", flush=True)
                        continue
                    if "skinny_us" not in r or us < r["skinny_us"]:
                        r["skinny_us"], r["config"] = us, config
                configs[f"{kind},{k},{n},{max(16, m)}"] = r["config"]  # keyed by BLOCK_M
                results[f"{shape_name} {name} m={m}"] = r
                print(shape_name, name, m, r, flush=True)
            sk.load_configs_dict(configs)
            chains[f"{shape_name} m={m}"] = chain = layer_chain(m, shape, layers)
            configs[f"layer,{shape[0]},0,{max(16, m)}"] = [int(chain["skinny_us"] < chain["separate_us"])]
            print(shape_name, m, "layer", chains[f"{shape_name} m={m}"], flush=True)
        del layers
        torch.cuda.empty_cache()
    import triton

    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__}
    lines = ["| product | rows | separate kernels (µs) | skinny (µs) | config (BN, BK, warps, stages, split K) |",
             "| --- | ---: | ---: | ---: | --- |"]
    for key, r in results.items():
        name, m = key.rsplit(" m=", 1)
        lines.append(f"| {name} | {m} | {r['separate_us']:.2f} | {r['skinny_us']:.2f} | {tuple(r['config'])} |")
    lines += ["", "| one layer without attention | rows | 7 separate kernels (µs) | 4 skinny kernels (µs) |",
              "| --- | ---: | ---: | ---: |"]
    for key, r in chains.items():
        name, m = key.rsplit(" m=", 1)
        lines.append(f"| {name} | {m} | {r['separate_us']:.2f} | {r['skinny_us']:.2f} |")
    header = (f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. Mean µs inside a "
              f"CUDA graph over {LAYERS} layers with distinct weights.\n\n")
    if args.configs:
        with open(args.configs, "w") as f:
            json.dump({"meta": meta, "configs": configs}, f, indent=1)
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()
