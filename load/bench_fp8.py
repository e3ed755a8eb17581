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

Speed (cuda): `pollen serve --model DIR --device cuda --warmup-seconds off` and the same with
--quantization fp8, both up at once on the one GPU: documents through EmbedStream as text
(load/bench_models.py's client, tokens answered in --seconds after a warm-up) to each in turn,
two rounds, the mean; then one text query at a time to each in turn, the order flipped every
query (unary Embed, p50 / p99 of 300 after 30), so host noise falls on both alike; and the
threshold the fp8 server logged (worker/models/fp8.py, measure_min_tokens).
Textbook W8A8 (--textbook-texts of the texts): transformers' own model with every product of its
layers fake-quantized in e4m3, an independent measure of what fp8 products cost on the weights;
--textbook-scales adds finer scale layouts (128 x 128 blocks, 32-value groups), to tell what the
scales cost from what e4m3's 3-bit mantissa does.
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
MODES = ("bf16", "fp8")
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
    from pollen.worker.eager_engine import EagerEngine
    from pollen.worker.models import fp8 as fp8_products
    from pollen.worker.models.loader import load_model
    from pollen.worker.packed import pack

    model = load_model(path, device, torch.bfloat16)
    if fp8:
        fp8_products.quantize_model(model, measure=False)
    if device == "cpu":
        engine = EagerEngine(model)
    else:
        from pollen.worker.cuda_engine import CudaEngine

        engine = CudaEngine(model, device, BATCH_TOKENS, cuda_graphs=False)
    out, batch, tokens = [], [], 0
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


# Textbook scale layouts: (group, block). group: one scale per that many consecutive values of a
# row of either operand (0: per row, i.e. per token and per output channel); block: the weights
# in 128 x 128 blocks instead (DeepSeek-V3's fp8 recipe, its activations in 1 x 128 groups).
TEXTBOOK_SCALES = {"channel": (0, False), "block128": (128, True), "group32": (32, False)}
TEXTBOOK_SCALES_TEXT = {"channel": "per token and per output channel (what pollen does)",
                        "block128": "1 x 128 activation groups and 128 x 128 weight blocks (DeepSeek-V3's recipe)",
                        "group32": "one scale per 32 values of either operand (the MX formats' block)"}


def through_e4m3(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 at the scale amax / 448 (e4m3's largest value) and back to float32."""
    scale = amax.clamp(min=1e-12) / 448.0
    return (x / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


def fake_e4m3(x: torch.Tensor, group: int, block: bool = False) -> torch.Tensor:
    """x through e4m3 and back, one scale per `group` consecutive values of the last dim (0: per
    row), or, with `block`, per `group` x `group` block of a matrix."""
    g = group or x.shape[-1]
    if x.shape[-1] % g or (block and x.shape[0] % g):
        raise SystemExit(f"--textbook-scales: a {tuple(x.shape)} operand does not split into groups of {g} "
                         "(the tiny shapes take channel scales only)")
    if block:
        blocks = x.reshape(x.shape[0] // g, g, x.shape[1] // g, g)
        return through_e4m3(blocks, blocks.abs().amax(dim=(1, 3), keepdim=True)).reshape(x.shape)
    groups = x.reshape(-1, x.shape[-1] // g, g)
    return through_e4m3(groups, groups.abs().amax(dim=-1, keepdim=True)).reshape(x.shape)


def textbook_rows(path: str, ids: list[np.ndarray], device: str, scales: str | None) -> np.ndarray:
    """An independent reference for what fp8 products cost in fidelity: transformers' own model in
    bfloat16, last-token pooled and normalized (Qwen3-Embedding's recipe), with every nn.Linear of
    its layers (unless `scales` is None) in textbook W8A8 e4m3 with the TEXTBOOK_SCALES layout,
    float32 products of the dequantized values."""
    from torch import nn
    from transformers import AutoModel

    class FakeFp8Linear(nn.Module):
        def __init__(self, linear: nn.Linear, group: int, block: bool):
            super().__init__()
            self.group, self.bias = group, linear.bias
            self.weight = fake_e4m3(linear.weight.float(), group, block)

        def forward(self, x):
            y = torch.nn.functional.linear(fake_e4m3(x.float(), self.group), self.weight)
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)

    model = AutoModel.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    if scales is not None:
        for module in list(model.layers.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, FakeFp8Linear(child, *TEXTBOOK_SCALES[scales]))
    out = []
    with torch.inference_mode():
        for seq in ids:  # one text at a time: no padding to mask
            out.append(model(input_ids=torch.as_tensor(seq, device=device)[None]).last_hidden_state[0, -1].float().cpu())
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    got = torch.stack(out).numpy().astype(np.float64)
    return got / np.linalg.norm(got, axis=1, keepdims=True)


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


def paired_query_latency(targets: dict[str, str], queries: list[str], warm: int = 30) -> dict[str, dict]:
    """One text query at a time to each server in turn (the order flipped every query), so that
    both see the same host at the same moments: p50 / p99 ms per server, after `warm` each."""
    import time

    import grpc

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    channels = {name: grpc.insecure_channel(t) for name, t in targets.items()}
    stubs = {name: pb_grpc.EmbedderStub(c) for name, c in channels.items()}
    names, times = list(targets), {name: [] for name in targets}
    try:
        for i, text in enumerate(queries):
            request = pb.EmbedRequest(texts=[text], normalize=True)
            for name in (names if i % 2 else names[::-1]):
                t = time.perf_counter()
                stubs[name].Embed(request)
                if i >= warm:
                    times[name].append(time.perf_counter() - t)
    finally:
        for channel in channels.values():
            channel.close()
    return {name: {"p50_ms": float(np.percentile(ms, 50) * 1e3), "p99_ms": float(np.percentile(ms, 99) * 1e3),
                   "n": len(ms)} for name, ms in times.items()}


def serve_pair(path: str, texts: list[str], counts: list[int], queries: list[str], seconds: float,
               load: StreamLoad, root: str, rounds: int = 2) -> dict[str, dict]:
    """`pollen serve` in bfloat16 and with --quantization fp8, both up at once on the one GPU:
    documents through EmbedStream to each in turn for `rounds` rounds (the mean), then queries to
    both in turn (paired_query_latency)."""
    from load.bench_mixed import stream_docs
    from tests.conftest import ServerProcess

    name = os.path.basename(path)
    logs = {mode: os.path.join(root, f"{name}-{mode}.log") for mode in MODES}
    servers = {}
    try:
        for mode in MODES:
            flags = ["--quantization", "fp8"] if mode == "fp8" else []
            servers[mode] = ServerProcess("--model", path, "--device", "cuda", "--warmup-seconds", "off", *flags,
                                          env={"PYTHONUNBUFFERED": "1"}, log=logs[mode]).start(timeout=900)
            check_tokens(servers[mode].listen, texts, counts)
        runs = {mode: [] for mode in MODES}
        for _ in range(rounds):
            for mode in MODES:
                runs[mode].append(stream_docs(servers[mode].listen, texts, "interactive", seconds, load=load))
        latency = paired_query_latency({mode: s.listen for mode, s in servers.items()}, queries)
    finally:
        for server in servers.values():
            server.terminate()
    out = {}
    for mode, got in runs.items():
        errors, answered = sum(g["errors"] for g in got), sum(g["texts"] for g in got)
        if errors or not answered:
            raise RuntimeError(f"{path} {mode}: {errors} errors, {answered} texts answered")
        out[mode] = {"tokens_per_s": float(np.mean([g["tokens_per_s"] for g in got])),
                     "rounds_tokens_per_s": [g["tokens_per_s"] for g in got], "query": latency[mode]}
        with open(logs[mode], errors="replace") as f:
            out[mode]["fp8_choice"] = next((line.split(": ", 2)[-1].strip() for line in f if "fp8 products" in line),
                                           "")
    return out


def markdown(meta: dict, shapes: list[dict], minilm: dict, args, smoke: bool) -> str:
    scales = args.textbook_scales.split(",")
    lines = ["| shape | texts (mean tokens) | fp8 vs bf16 cosine mean / p1 / min |"
             + "".join(f" textbook W8A8, {name} scales: cosine mean / min |" for name in scales)
             + (" bf16 docs tokens/s | fp8 docs tokens/s | fp8 / bf16 | query p50 bf16 / fp8 | fp8 from |"
                if not args.skip_speed else ""),
             "| --- | --- | ---: |" + " ---: |" * len(scales)
             + (" ---: | ---: | ---: | ---: | --- |" if not args.skip_speed else "")]
    for r in shapes:
        c = r["cosine"]
        t = r["textbook"]
        line = (f"| {r['shape']} | {r['texts']:,} ({r['mean_tokens']:.0f}) | {c['mean']:.5f} / {c['p1']:.5f} / "
                f"{c['min']:.5f} |" + "".join(f" {t['cosine'][name]['mean']:.5f} / {t['cosine'][name]['min']:.5f} "
                                              f"({t['texts']:,} texts) |" for name in scales))
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
                                         else "") + ". Textbook W8A8: the same cosine from transformers' own model "
            "with every product of its layers fake-quantized in e4m3, an independent measure of what fp8 products "
            "cost on these weights; its scales: " + "; ".join(f"{name}, {TEXTBOOK_SCALES_TEXT[name]}" for name in scales)
            + ".\n\n" + "\n".join(lines) + "\n")
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
    p.add_argument("--stsb", default=None, help="the STS-B test CSV (default: the one tests/data ships)")
    p.add_argument("--texts", type=int, default=None, help="texts of the fidelity measure, per shape (default: "
                   "1,000; 40 on the cpu)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds of each docs run")
    p.add_argument("--skip-speed", action="store_true", help="fidelity only")
    p.add_argument("--textbook-texts", type=int, default=200, help="texts of the independent reference "
                   "(transformers' model with textbook fp8 products), per shape")
    p.add_argument("--textbook-scales", default="channel", help="comma-separated scale layouts of the textbook "
                   f"reference, of {', '.join(TEXTBOOK_SCALES)} (channel: per token and per output channel)")
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
        some = ids[:args.textbook_texts]
        plain = textbook_rows(path, some, args.device, None)
        row["textbook"] = {"texts": len(some), "cosine": {
            scales: cosines(textbook_rows(path, some, args.device, scales), plain)
            for scales in args.textbook_scales.split(",")}}
        print(f"{name}: fp8 vs bf16 cosine {row['cosine']}; textbook W8A8 in transformers {row['textbook']}",
              flush=True)
        if not args.skip_speed:
            load = StreamLoad(processes=2, streams=4, window=8, per_message=work.per_message,
                              connection_per_stream=True, warm=work.warm, normalize=True)
            queries = corpus.queries(330)
            row.update(serve_pair(path, texts, counts, queries, args.seconds, load, args.root))
            for mode in MODES:
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
