"""GPU engine benchmark: pollen's engine (eager and CUDA graphs) against HF transformers, same run.

    python load/bench_engine.py [--shapes qwen3-0.6b,bert-base] [--docs-only] [--queries-only]
           [--engine-options skinny=0,...]  (pollen.common.engine_options.EngineOptions, NAME=VALUE)

Per shape (random weights in the real HF format, made here, read through pollen's loader):
  check    our embeddings vs HF transformers float32 on the same weights (cosine, both attention
           modes for Qwen3), graph output vs eager output
  queries  one text of 8..32 tokens at a time: p50 / p99 latency
  docs     log-normal lengths, median 200, clipped to 16..2048 (512 for BERT): tokens/s
  long     64 texts of 8,192 tokens (Qwen3 only): tokens/s
HF runs the sentence-transformers method: texts sorted by length, padded per batch, bf16, sdpa, at
the best of batch sizes 32/64/128 chosen on the first 2,000 texts. MFU is against a bf16 matrix
product rate measured in the same run. Writes load/results/engine-<kind>.md (load/results_file.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.gpu_models import SHAPES, make_checkpoint, pplx_variant  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402
from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.worker.cuda_engine import CudaEngine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402

DOCS = {"qwen3-0.6b": 20000, "qwen3-4b": 5000, "qwen3-8b": 3000, "bert-base": 20000}
BUDGET = {"qwen3-0.6b": 16384, "qwen3-4b": 16384, "qwen3-8b": 16384, "bert-base": 32768}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ---------------------------------------------------------------- workloads (fixed seeds)

def queries(n, vocab, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(8, 33), dtype=np.int32) for _ in range(n)]


def docs(n, vocab, hi, seed=2):
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(200), 0.8, n)), 16, hi).astype(int)
    return [rng.integers(0, vocab, k, dtype=np.int32) for k in lengths]


def long_texts(vocab, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, 8192, dtype=np.int32) for _ in range(64)]


# ---------------------------------------------------------------- runners

def greedy_batches(seqs, budget):
    out, cur, used = [], [], 0
    for s in seqs:
        if cur and used + len(s) > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += len(s)
    if cur:
        out.append(cur)
    return out


def ours_throughput(engine, seqs, budget):
    """Arrival order, token-budget batches, batch N+1 submitted before N's result is read."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    pending = None
    for batch in greedy_batches(seqs, budget):
        nxt = engine.submit(pack(batch))
        if pending is not None:
            pending.result()
        pending = nxt
    pending.result()
    return time.perf_counter() - start


def ours_rows(engine, seqs, budget=16384):
    rows = []
    for batch in greedy_batches(seqs, budget):
        rows.append(engine.submit(pack(batch)).result().copy())
    return np.concatenate(rows)


def latency(fn, items, warm=20):
    for s in items[:warm]:
        fn(s)
    out = []
    for s in items[warm:]:
        t = time.perf_counter()
        fn(s)
        out.append(time.perf_counter() - t)
    ms = np.array(out) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "n": len(ms)}


@torch.inference_mode()
def hf_embed(model, seqs, bs, pooling, bidirectional=False):
    """The sentence-transformers method: sort by length, pad per batch, pool, copy to the host."""
    order = np.argsort([len(s) for s in seqs], kind="stable")
    out = [None] * len(seqs)
    for i in range(0, len(seqs), bs):
        idx = order[i:i + bs]
        n = max(len(seqs[j]) for j in idx)
        ids = np.zeros((len(idx), n), np.int64)
        mask = np.zeros((len(idx), n), np.int64)
        for r, j in enumerate(idx):
            ids[r, :len(seqs[j])] = seqs[j]
            mask[r, :len(seqs[j])] = 1
        ids, mask = torch.from_numpy(ids).cuda(non_blocking=True), torch.from_numpy(mask).cuda(non_blocking=True)
        am = mask
        if bidirectional:  # pplx-style: every real token sees every real token
            am = (mask[:, None, :, None] * mask[:, None, None, :]).bool()
        h = model(input_ids=ids, attention_mask=am).last_hidden_state
        if pooling == "last":
            pooled = h[torch.arange(len(idx), device=h.device), mask.sum(1) - 1]
        elif pooling == "cls":
            pooled = h[:, 0]
        else:
            m = mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1)
        pooled = pooled.float().cpu().numpy()
        for r, j in enumerate(idx):
            out[j] = pooled[r]
    return np.stack(out)


def hf_throughput(model, seqs, bs, pooling):
    torch.cuda.synchronize()
    t = time.perf_counter()
    hf_embed(model, seqs, bs, pooling)
    return time.perf_counter() - t


def load_hf(path, dtype):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").cuda().eval()


def matmul_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192 ** 3 / (time.perf_counter() - t)


def flops(shape, seqs, causal):
    c = SHAPES[shape]
    h, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    heads = c["num_attention_heads"]
    hd = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads") or heads
    mlp = (3 if c["kind"] == "qwen3" else 2) * h * inter
    per_token = 2 * layers * (h * (heads + 2 * kv) * hd + heads * hd * h + mlp)
    lengths = np.array([len(s) for s in seqs], dtype=np.float64)
    attn = 4 * layers * heads * hd * (lengths ** 2).sum() * (0.5 if causal else 1.0)
    return per_token * lengths.sum() + attn


def cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


# ---------------------------------------------------------------- per shape

def check(shape, path, results, options):
    """Ours (bf16 eager, bf16 graphs, fp32) vs HF float32 on the same weights and texts."""
    kind = SHAPES[shape]["kind"]
    rng = np.random.default_rng(7)
    vocab = SHAPES[shape]["vocab_size"]
    seqs = [rng.integers(0, vocab, k, dtype=np.int32) for k in rng.integers(4, 300, 24)]
    # Queries one at a time as well: up to 64 tokens the engine takes its five-kernel layer.
    singles = [rng.integers(0, vocab, k, dtype=np.int32) for k in rng.integers(8, 33, 16)]
    hf = load_hf(path, torch.float32)
    modes = [("causal", path, "last"), ("bidirectional", pplx_variant(path), "mean")] if kind == "qwen3" \
        else [("bidirectional", path, "mean")]
    out = {}
    for mode, mpath, pooling in modes:
        bidirectional = mode == "bidirectional" and kind == "qwen3"
        ref = hf_embed(hf, seqs, 1, pooling, bidirectional=bidirectional)
        ref_singles = hf_embed(hf, singles, 1, pooling, bidirectional=bidirectional)
        row = {}
        for label, dtype, graphs in (("fp32", torch.float32, False), ("bf16_eager", torch.bfloat16, False),
                                     ("bf16_graphs", torch.bfloat16, True)):
            model = load_model(mpath, device="cuda", dtype=dtype, options=options)
            engine = CudaEngine(model, "cuda", max_batch_tokens=16384, cuda_graphs=graphs)
            engine.warm_up()
            ours = ours_rows(engine, seqs)
            row[label] = {"min_cos": float(cosines(ours, ref).min()), "max_abs": float(np.abs(ours - ref).max())}
            row[label + "_rows"] = ours
            if label == "bf16_graphs":
                got = np.concatenate([engine.submit(pack([q])).result().copy() for q in singles])
                row["bf16_graphs_queries"] = {"min_cos": float(cosines(got, ref_singles).min()),
                                              "max_abs": float(np.abs(got - ref_singles).max())}
            del engine, model
            torch.cuda.empty_cache()
        e, g = row.pop("bf16_eager_rows"), row.pop("bf16_graphs_rows")
        row.pop("fp32_rows")
        row["graph_vs_eager"] = {"min_cos": float(cosines(g, e).min()),
                                 "max_rel": float(np.abs(g - e).max() / np.abs(e).max())}
        out[mode] = row
        log(shape, mode, json.dumps(row))
    del hf
    torch.cuda.empty_cache()
    # The dtype's own floor on this shape: HF transformers in bf16 against HF in float32.
    hf16 = load_hf(path, torch.bfloat16)
    ref = hf_embed(load_hf(path, torch.float32), seqs, 1, "last" if kind == "qwen3" else "mean")
    results["hf_bf16_vs_fp32_min_cos"] = float(cosines(hf_embed(hf16, seqs, 1, "last" if kind == "qwen3" else "mean"),
                                                   ref).min())
    log(shape, "HF bf16 vs HF fp32 (causal)", results["hf_bf16_vs_fp32_min_cos"])
    del hf16
    torch.cuda.empty_cache()
    results["check"] = out


def bench_shape(shape, root, rate, args):
    kind = SHAPES[shape]["kind"]
    vocab = SHAPES[shape]["vocab_size"]
    log("checkpoint", shape)
    t = time.perf_counter()
    path = make_checkpoint(shape, root)
    res = {"shape": shape, "checkpoint_seconds": time.perf_counter() - t}
    if not (args.skip_check or args.docs_only):
        check(shape, path, res, args.engine_options)
    budget = BUDGET[shape]
    causal = kind == "qwen3"
    pooling = "last" if causal else "mean"
    hi = 512 if kind == "bert" else 2048
    q = queries(args.queries + 20, vocab)
    d = docs(int(DOCS[shape] * args.docs_scale), vocab, hi)
    longs = long_texts(vocab) if kind == "qwen3" and not (args.skip_long or args.docs_only) else []

    # ---- ours, eager then graphs
    for label, graphs in (("graphs", True),) if args.docs_only else (("eager", False), ("graphs", True)):
        model = load_model(path, device="cuda", dtype=torch.bfloat16, options=args.engine_options,
                           quantization=args.quantization)
        engine = CudaEngine(model, "cuda", max_batch_tokens=budget, cuda_graphs=graphs)
        engine.warm_up()
        torch.cuda.synchronize()
        reserved0 = torch.cuda.memory_reserved()
        r = {}
        if not args.docs_only:
            r["queries"] = latency(lambda s: engine.submit(pack([s])).result(), q)
        if args.queries_only:
            res["ours_" + label] = r
            log(shape, label, json.dumps(r))
            continue
        ours_throughput(engine, d[:2000], budget)  # captures the common buckets (lazily)
        secs = ours_throughput(engine, d, budget)
        toks = sum(len(s) for s in d)
        r["docs"] = {"tokens_per_s": toks / secs, "seconds": secs, "tokens": toks,
                     "mfu": flops(shape, d, causal) / secs / rate}
        if longs:
            ours_throughput(engine, longs[:4], budget)
            secs = ours_throughput(engine, longs, budget)
            r["long"] = {"tokens_per_s": 64 * 8192 / secs, "seconds": secs,
                         "mfu": flops(shape, longs, causal) / secs / rate}
        torch.cuda.synchronize()
        r["memory_after_run_gib"] = (torch.cuda.memory_reserved() - reserved0) / 2 ** 30
        if graphs and not args.docs_only:  # --docs-only (the A/B figure) uses only submit() and result()
            r["graphs_captured"] = len(engine.graphs)
            r["capture_seconds"] = engine.capture_seconds
        res["ours_" + label] = r
        log(shape, label, json.dumps(r))
        del engine, model
        torch.cuda.empty_cache()

    if args.queries_only or args.docs_only:
        return res
    if causal and not args.skip_bidir:
        model = load_model(pplx_variant(path), device="cuda", dtype=torch.bfloat16, options=args.engine_options,
                           quantization=args.quantization)
        engine = CudaEngine(model, "cuda", max_batch_tokens=budget, cuda_graphs=True)
        engine.warm_up()
        ours_throughput(engine, d[:2000], budget)
        secs = ours_throughput(engine, d, budget)
        res["ours_graphs_bidirectional"] = {"docs_tokens_per_s": sum(len(s) for s in d) / secs,
                                            "mfu": flops(shape, d, False) / secs / rate}
        log(shape, "bidirectional", json.dumps(res["ours_graphs_bidirectional"]))
        del engine, model
        torch.cuda.empty_cache()

    # ---- HF transformers, bf16 sdpa, the sentence-transformers method
    hf = load_hf(path, torch.bfloat16)
    r = {"queries": latency(lambda s: hf_embed(hf, [s], 1, pooling), q[:120])}  # noqa: F821 (ruff: `del hf` below)
    sizes = {}
    for bs in (32, 64, 128):
        hf_throughput(hf, d[:256], bs, pooling)
        sizes[bs] = sum(len(s) for s in d[:2000]) / hf_throughput(hf, d[:2000], bs, pooling)
    best = max(sizes, key=sizes.get)
    secs = hf_throughput(hf, d, best, pooling)
    r["batch_size_tokens_per_s"] = sizes
    r["docs"] = {"batch_size": best, "tokens_per_s": sum(len(s) for s in d) / secs, "seconds": secs,
                 "mfu": flops(shape, d, causal) / secs / rate}
    if longs:
        lsizes = {}
        for bs in (2, 4, 8):
            lsizes[bs] = 16 * 8192 / hf_throughput(hf, longs[:16], bs, pooling)
        lbest = max(lsizes, key=lsizes.get)
        secs = hf_throughput(hf, longs, lbest, pooling)
        r["long"] = {"batch_size": lbest, "tokens_per_s": 64 * 8192 / secs, "seconds": secs,
                     "mfu": flops(shape, longs, causal) / secs / rate}
    res["hf"] = r
    log(shape, "hf", json.dumps(r))
    del hf
    torch.cuda.empty_cache()
    return res


def versions():
    import transformers

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        driver = "?"
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver,
            "transformers": transformers.__version__, "python": platform.python_version()}


def _latency(r: dict | None) -> str:
    return f"{r['queries']['p50_ms']:.2f} / {r['queries']['p99_ms']:.2f}" if r and "queries" in r else "-"


def _rate(r: dict | None, workload: str, batch_size: bool = False) -> str:
    if not r or workload not in r:
        return "-"
    w = r[workload]
    return f"{w['tokens_per_s']:,.0f} ({w['mfu']:.0%}" + (f", bs {w['batch_size']})" if batch_size else ")")


def markdown(meta, rate, shapes):
    lines = [f"{meta['gpu']}, driver {meta['driver']}, torch {meta['torch']} (CUDA {meta['cuda']}), "
             f"transformers {meta['transformers']}, Python {meta['python']}, {meta['date']}. bf16 matrix product "
             f"rate measured in this run: {rate / 1e12:.0f} TFLOP/s (MFU is against it).", "",
             "Random weights in the real HF format, loaded through pollen's loader. Causal attention on both sides "
             "for the HF comparison." + (f" pollen's timed runs with --quantization {meta['quantization']}."
                                         if meta.get("quantization", "none") != "none" else ""), "",
             "| shape | workload | HF transformers | pollen eager | pollen graphs | graphs / HF |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in shapes:
        hf, e, g = s.get("hf"), s.get("ours_eager"), s.get("ours_graphs")
        if "queries" in g:
            ratio = f"{hf['queries']['p50_ms'] / g['queries']['p50_ms']:.1f}x faster" if hf else ""
            lines.append(f"| {s['shape']} | queries p50 / p99 (ms) | {_latency(hf)} | {_latency(e)} | {_latency(g)} "
                         f"| {ratio} |")
        for w in ("docs", "long"):
            if w in g:
                ratio = f"{g[w]['tokens_per_s'] / hf[w]['tokens_per_s']:.2f}x" if hf and w in hf else ""
                lines.append(f"| {s['shape']} | {w} tokens/s (MFU) | {_rate(hf, w, True)} | {_rate(e, w)} "
                             f"| {_rate(g, w)} | {ratio} |")
        if "ours_graphs_bidirectional" in s:
            b = s["ours_graphs_bidirectional"]
            lines.append(f"| {s['shape']} | docs, bidirectional (pplx mode) | | | {b['docs_tokens_per_s']:,.0f} ({b['mfu']:.0%}) | |")
    if any("graphs_captured" in s["ours_graphs"] for s in shapes):
        lines += ["", "CUDA graphs: buckets captured lazily during the run, and GPU memory the run added "
                  "(caching allocator, graphs' shared pool included):", ""]
        for s in shapes:
            g, e = s["ours_graphs"], s.get("ours_eager", {})
            if "graphs_captured" in g:
                eager = f" vs +{e['memory_after_run_gib']:.2f} GiB eager" if "memory_after_run_gib" in e else ""
                lines.append(f"- {s['shape']}: {g['graphs_captured']} graphs, captured in {g['capture_seconds']:.1f} s; "
                             f"+{g['memory_after_run_gib']:.2f} GiB with graphs{eager}")
    if any("check" in s for s in shapes):
        lines += ["", "Correctness against HF transformers float32 on the same weights (24 texts of 4..300 tokens "
                  "in one batch; and 16 queries of 8..32 tokens one at a time, through the query kernels):", "",
                  "| shape | mode | fp32 min cosine | bf16 eager min cosine | bf16 graphs min cosine | graph vs eager min cosine "
                  "| bf16 graphs, queries one at a time |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for s in shapes:
            for mode, row in s.get("check", {}).items():
                single = row.get("bf16_graphs_queries", {}).get("min_cos")
                lines.append(f"| {s['shape']} | {mode} | {row['fp32']['min_cos']:.7f} | {row['bf16_eager']['min_cos']:.5f} "
                             f"| {row['bf16_graphs']['min_cos']:.5f} | {row['graph_vs_eager']['min_cos']:.6f} "
                             f"| {'' if single is None else f'{single:.5f}'} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-0.6b,bert-base")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    add_out_argument(p, "engine")
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--docs-scale", type=float, default=1.0)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--skip-long", action="store_true")
    p.add_argument("--skip-bidir", action="store_true")
    p.add_argument("--queries-only", action="store_true", help="our engine's query latency alone (no HF)")
    p.add_argument("--docs-only", action="store_true",
                   help="our engine's docs tokens/s with graphs alone (no check, eager, HF, queries, long or bidirectional)")
    p.add_argument("--engine-options", type=EngineOptions.parse, default=EngineOptions(),
                   help="NAME=VALUE,... of pollen.common.engine_options.EngineOptions, e.g. skinny=0")
    p.add_argument("--quantization", default="none", choices=("none", "fp8"),
                   help="the timed runs' products (the check against HF stays unquantized): fp8 as "
                        "`pollen serve --quantization fp8`, from the batch size the load measures")
    args = p.parse_args()
    meta = versions()
    meta["engine_options"] = dataclasses.asdict(args.engine_options)
    meta["quantization"] = args.quantization
    rate = matmul_rate()
    log("matmul", rate / 1e12, "TFLOP/s", meta)
    shapes = [bench_shape(shape, args.root, rate, args) for shape in args.shapes.split(",")]
    md = markdown(meta, rate, shapes)
    print(md)
    write_result("engine", device_kind(), "GPU engine benchmark", md,
                 {"meta": meta, "matmul_flops": rate, "shapes": shapes}, args.out)


if __name__ == "__main__":
    main()
