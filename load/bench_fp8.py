"""fp8 products (`--quantization fp8`) against bfloat16 in one run: how far each vector moves, and
how much faster `pollen serve` answers.

    python load/bench_fp8.py --qwen3-tokenizer FILE [--shapes qwen3-0.6b,qwen3-4b,qwen3-8b] [--texts 1000]
           [--seconds 10] [--stsb CSV] [--minilm DIR] [--skip-speed] [--out FILE]
    python load/bench_fp8.py --device cpu    # fidelity only: tiny shapes, a few texts, torch's references
    python load/bench_fp8.py --device cpu --full-size --shapes qwen3-0.6b --texts 100 --qwen3-tokenizer FILE

Fidelity, in this process: each shape's model in bfloat16, then the same weights with fp8 products
at every batch size (the load's measured threshold set aside: the worst case), on --texts texts
(STS-B sentences joined and cut to 30..512 tokens of the real Qwen3 tokenizer, as
load/bench_models.py makes them): each text's cosine between the two vectors, mean and min. Random
weights in the real shapes (load/arch_models.py). all-MiniLM-L6-v2's real weights (--minilm,
default: its bundled package): STS-B test Spearman x100 in bfloat16 and in fp8, and the cosines.
On the CPU the numerics are the same quantization through the torch references
(worker/models/ops.py), which the CUDA kernels equal (tests/test_cuda_fp8.py).

Speed (cuda): `pollen serve --model DIR --device cuda --warmup-seconds off`, then the same with
--quantization fp8: documents through EmbedStream as text (load/bench_models.py's client, tokens
answered in --seconds after a warm-up), then one text query at a time (unary Embed, p50 / p99 of
300 after 30), and the threshold the fp8 server logged (worker/models/fp8.py, measure_min_tokens).
Writes load/results/fp8-<kind>.md (load/results_file.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load import corpus  # noqa: E402
from load.arch_models import Tokenizer, make_checkpoint  # noqa: E402
from load.bench_mixed import StreamLoad  # noqa: E402
from load.bench_models import SMOKE, WORKLOADS, check_tokens, make_texts, sentences, versions  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402

SHAPES = ("qwen3-0.6b", "qwen3-4b", "qwen3-8b")
BATCH_TOKENS = 8192  # fidelity batches: texts packed up to this many tokens


def token_ids(folder: str, texts: list[str], limit: int) -> list[np.ndarray]:
    from tokenizers import Tokenizer as HfTokenizer

    tok = HfTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(limit)
    return [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(texts)]


def rows(path: str, ids: list[np.ndarray], device: str, fp8: bool) -> np.ndarray:
    """Every text's pooled row from the model in bfloat16, its layers' products in fp8 at every
    batch size when `fp8`; normalized."""
    from pollen.worker.engine import EagerEngine
    from pollen.worker.models import fp8 as fp8_products
    from pollen.worker.models.loader import load_model
    from pollen.worker.packed import pack

    model = load_model(path, device, torch.bfloat16)
    if fp8:
        fp8_products.quantize_model(model, measure=False)
    engine, out, batch, tokens = EagerEngine(model), [], [], 0
    for seq in [*ids, None]:
        if batch and (seq is None or tokens + len(seq) > BATCH_TOKENS):
            out.append(engine.submit(pack(batch)).result().copy())
            batch, tokens = [], 0
        if seq is not None:
            batch.append(seq)
            tokens += len(seq)
    del engine, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    got = np.concatenate(out).astype(np.float64)
    return got / np.linalg.norm(got, axis=1, keepdims=True)


def cosines(a: np.ndarray, b: np.ndarray) -> dict:
    c = (a * b).sum(1)
    return {"mean": float(c.mean()), "min": float(c.min()), "p1": float(np.percentile(c, 1))}


def minilm_fidelity(path: str, stsb: str | None, device: str, pairs_limit: int | None) -> dict:
    from scipy.stats import spearmanr

    from tests.texts import stsb_pairs

    pairs = stsb_pairs(stsb)[:pairs_limit]
    texts = [a for a, _, _ in pairs] + [b for _, b, _ in pairs]
    gold = np.array([score for _, _, score in pairs])
    ids = token_ids(path, texts, 256)
    out = {"pairs": len(pairs)}
    vectors = {}
    for name in ("bf16", "fp8"):
        v = vectors[name] = rows(path, ids, device, name == "fp8")
        n = len(pairs)
        out[f"stsb_{name}"] = float(spearmanr((v[:n] * v[n:]).sum(1), gold).statistic * 100)
    out["cosine"] = cosines(vectors["fp8"], vectors["bf16"])
    return out


def serve_run(path: str, texts: list[str], counts: list[int], queries: list[str], seconds: float,
              load: StreamLoad, flags: list[str], log: str) -> dict:
    from load.bench_e2e import query_latency
    from load.bench_mixed import stream_docs
    from tests.conftest import ServerProcess

    server = ServerProcess("--model", path, "--device", "cuda", "--warmup-seconds", "off", *flags,
                           env={"PYTHONUNBUFFERED": "1"}, log=log).start(timeout=900)
    try:
        check_tokens(server.listen, texts, counts)
        got = stream_docs(server.listen, texts, "interactive", seconds, load=load)
        got["query"] = query_latency(server.listen, queries, texts=True)
    finally:
        server.terminate()
    if got["errors"] or not got["texts"]:
        raise RuntimeError(f"{path} {flags}: {got['errors']} errors, {got['texts']} texts answered")
    with open(log, errors="replace") as f:
        got["fp8_choice"] = next((line.split(": ", 2)[-1].strip() for line in f if "fp8 products" in line), "")
    return got


def markdown(meta: dict, shapes: list[dict], minilm: dict, args, smoke: bool) -> str:
    lines = ["| shape | texts (mean tokens) | fp8 vs bf16 cosine mean / p1 / min |"
             + (" bf16 docs tokens/s | fp8 docs tokens/s | fp8 / bf16 | query p50 bf16 / fp8 | fp8 from |"
                if not args.skip_speed else ""),
             "| --- | --- | ---: |" + (" ---: | ---: | ---: | ---: | --- |" if not args.skip_speed else "")]
    for r in shapes:
        c = r["cosine"]
        line = f"| {r['shape']} | {r['texts']:,} ({r['mean_tokens']:.0f}) | {c['mean']:.5f} / {c['p1']:.5f} / {c['min']:.5f} |"
        if "bf16" in r:
            b, f = r["bf16"], r["fp8"]
            line += (f" {b['tokens_per_s']:,.0f} | {f['tokens_per_s']:,.0f} | {f['tokens_per_s'] / b['tokens_per_s']:.2f}x |"
                     f" {b['query']['p50_ms']:.2f} / {f['query']['p50_ms']:.2f} ms | {f['fp8_choice']} |")
        lines.append(line)
    text = (f"{meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}, Python "
            f"{meta['python']}; {meta['date']}. Random weights in Qwen3-Embedding's shapes (load/arch_models.py"
            + (", tiny), a stand-in BPE" if smoke else "), the real Qwen3 tokenizer")
            + "; fidelity with fp8 products at every batch size against bfloat16 on the "
            "same weights and texts" + (", through torch's reference quantization on the CPU" if args.device == "cpu"
                                         else "") + ".\n\n" + "\n".join(lines) + "\n")
    if minilm:
        c = minilm["cosine"]
        text += (f"\nall-MiniLM-L6-v2 (real weights), STS-B test ({minilm['pairs']:,} pairs): Spearman x100 "
                 f"bfloat16 {minilm['stsb_bf16']:.3f}, fp8 {minilm['stsb_fp8']:.3f} "
                 f"(difference {minilm['stsb_fp8'] - minilm['stsb_bf16']:+.3f}); fp8 vs bf16 cosine mean "
                 f"{c['mean']:.5f}, p1 {c['p1']:.5f}, min {c['min']:.5f}.\n")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: fidelity only, tiny shapes and a few texts")
    p.add_argument("--root", default="/tmp/pollen-ckpt", help="where the checkpoints are written once")
    p.add_argument("--qwen3-tokenizer", default=os.environ.get("POLLEN_QWEN3_TOKENIZER"),
                   help="the real Qwen3 tokenizer.json (default: POLLEN_QWEN3_TOKENIZER)")
    p.add_argument("--minilm", default=None, help="all-MiniLM-L6-v2's folder (default: the bundled package's)")
    p.add_argument("--stsb", default=None, help="the STS-B test CSV (default: POLLEN_STSB, else ../shared's)")
    p.add_argument("--texts", type=int, default=None, help="texts of the fidelity measure, per shape (default: "
                   "1,000; 40 on the cpu)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds of each docs run")
    p.add_argument("--skip-speed", action="store_true", help="fidelity only")
    p.add_argument("--full-size", action="store_true",
                   help="on the cpu: the shapes at their real sizes and every STS-B pair (slow: minutes a 100 texts)")
    add_out_argument(p, "fp8")
    args = p.parse_args()
    smoke = args.device == "cpu" and not args.full_size
    args.skip_speed = args.skip_speed or args.device == "cpu"
    args.texts = args.texts or (40 if smoke else 1000)
    if not smoke and not args.qwen3_tokenizer:
        raise SystemExit("--qwen3-tokenizer (or POLLEN_QWEN3_TOKENIZER) is needed on the GPU and with --full-size")
    from pollen.common.model_spec import default_model_path

    minilm_path = args.minilm or default_model_path()
    tokenizer = Tokenizer(minilm_path, None if smoke else args.qwen3_tokenizer, "Qwen3's BPE (real)")
    pool, _ = sentences(args.stsb)
    shapes = []
    for name in filter(None, args.shapes.split(",")):
        path = make_checkpoint(name, args.root, tokenizer, tiny=smoke, device=args.device)
        docs = args.texts if args.skip_speed else max(args.texts, 2000)
        work = dataclasses.replace(SMOKE if smoke else WORKLOADS[name], docs=docs)
        texts, counts = make_texts(path, pool, work, 512)
        fidelity = texts[:args.texts]
        ids = token_ids(path, fidelity, 512)
        row = {"shape": name, "texts": len(fidelity), "mean_tokens": float(np.mean([len(i) for i in ids]))}
        row["cosine"] = cosines(rows(path, ids, args.device, True), rows(path, ids, args.device, False))
        print(f"{name}: fp8 vs bf16 cosine {row['cosine']}", flush=True)
        if not args.skip_speed:
            load = StreamLoad(processes=2, streams=4, window=8, per_message=work.per_message,
                              connection_per_stream=True, warm=work.warm, normalize=True)
            queries = corpus.queries(330)
            for mode in ("bf16", "fp8"):
                flags = ["--quantization", "fp8"] if mode == "fp8" else []
                row[mode] = serve_run(path, texts, counts, queries, args.seconds, load, flags,
                                      os.path.join(args.root, f"{name}-{mode}.log"))
                print(f"{name} {mode}: {row[mode]['tokens_per_s']:,.0f} tokens/s, query p50 "
                      f"{row[mode]['query']['p50_ms']:.2f} ms {row[mode]['fp8_choice']}", flush=True)
        shapes.append(row)
    minilm = minilm_fidelity(minilm_path, args.stsb, args.device, 40 if smoke else None)
    print(f"all-MiniLM-L6-v2: {minilm}", flush=True)
    meta = versions(args.device)
    write_result("fp8", device_kind(args.device), "fp8 products against bfloat16: fidelity and speed",
                 markdown(meta, shapes, minilm, args, smoke), {"meta": meta, "shapes": shapes, "minilm": minilm},
                 args.out)


if __name__ == "__main__":
    main()
