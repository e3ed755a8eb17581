"""Sparse and multi-output embedders through `pollen serve`, against the reference implementations
run on the same device in the same run.

    python load/bench_sparse.py --bert-tokenizer DIR [--xlmr-tokenizer DIR] [--stsb CSV]
           [--rows splade,bge-m3,dense] [--docs N] [--seconds 10] [--warm S] [--out FILE]
    python load/bench_sparse.py --device cpu    # a smoke run: tiny shapes, a few docs, seconds

Texts: STS-B sentences joined and cut to 30 to 512 tokens (log-uniform) in each folder's own
tokenizer (load/bench_models.py's make_texts), sent as text (the server tokenizes).

  splade   splade-bert-base: a BertForMaskedLM of BERT-base's shape (hidden 768, 12 layers, 12
           heads, 3,072, vocabulary 30,522), random weights, BERT's uncased WordPiece from
           --bert-tokenizer, saved as sentence-transformers' SparseEncoder saves a SPLADE model
           (MLMTransformer, SpladePooling max). The MLM bias is shifted so that a text of about
           100 tokens keeps about TERMS terms, as a trained SPLADE model's rows do (a random
           model's would hold most of the vocabulary). pollen answers OUTPUT_SPARSE. Reference:
           transformers AutoModelForMaskedLM in bf16 and the SPLADE recipe, log1p(relu(logits)) *
           attention_mask, max over positions, each batch's non-zero entries moved to the CPU as
           sparse rows (a COO tensor), texts longest first as sentence-transformers orders them.
  bge-m3   bge-m3 all outputs: load/m3_models.py's folder in the real shape (XLM-R-large and
           FlagEmbedding's two heads), with --xlmr-tokenizer's files (default: --bert-tokenizer's
           WordPiece, a stand-in: XLM-R's own ships in no package here). pollen answers
           OUTPUT_DENSE, OUTPUT_SPARSE and OUTPUT_TOKENS from one forward pass. Reference:
           FlagEmbedding's BGEM3FlagModel(use_fp16=True).encode(return_dense, return_sparse,
           return_colbert_vecs) where `import FlagEmbedding` works, else its recipe in transformers:
           XLMRobertaModel in bf16, dense the normalized CLS state, sparse relu(sparse_linear(h))
           max-pooled per token id on the GPU (the cls, eos, pad and unk ids dropped), ColBERT the
           normalized colbert_linear(h) of every token after the first; all moved to the CPU.
  dense    bge-m3 dense only: the same server asked OUTPUT_DENSE alone, against the same weights
           served as a plain XLM-R embedder (the folder without its two .pt heads), both servers
           up at once and loaded in turn, DENSE_ROUNDS rounds each: tokens/s of each (the mean)
           through `pollen serve`, and their ratio.

pollen: `pollen serve --model DIR --device cuda --warmup-seconds off`; texts through EmbedStream
(load/bench_mixed.py's client), normalized, CLIENT_PROCESSES processes x STREAMS streams, each on
its own connection keeping IN_FLIGHT messages in flight, going round the texts; after --warm
seconds, the tokens and texts answered in --seconds (tokens as the answers' usage, checked against
this script's count). A server that refuses the SPLADE folder at start leaves that row's pollen
figure as "refused by the server: <its message>"; the reference still runs. The references run in
this process after the servers have stopped, every text once per batch size, after a warm-up; the
best batch size makes the ratio.

Writes load/results/sparse-<kind>.md (load/results_file.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.bench_mixed import StreamLoad, stream_docs  # noqa: E402
from load.bench_models import Workload, check_tokens, make_texts, sentences  # noqa: E402
from load.library_defaults import NOTE, library_defaults  # noqa: E402
from load.m3_models import make_bge_m3  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402

CLIENT_PROCESSES, STREAMS, IN_FLIGHT = 2, 4, 8
# The dense row compares two servers a few percent apart: both are up at once and take the load in
# turn, this many rounds each, so that host noise falls on both alike.
DENSE_ROUNDS = 2
SPLADE_BATCHES, M3_BATCHES = (32, 128), (32, 128, 256)  # 256: FlagEmbedding's default batch size
ROWS = ("splade", "bge-m3", "dense")
TERMS = 200  # terms a text of about 100 tokens keeps

SPLADE_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, max_position_embeddings=512)
SPLADE_TINY = dict(SPLADE_BASE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)

# bge-m3's rows share one folder and its texts; all outputs send 16 texts a message (their token
# vectors stay under the server's --max-token-vectors of 16,384 a request).
WORKLOADS = {"splade": Workload(4000, 30, 512, 32, warm=6.0), "bge-m3": Workload(4000, 30, 512, 16, warm=10.0),
             "dense": Workload(4000, 30, 512, 32, warm=10.0)}
SMOKE = Workload(12, 8, 48, 4, warm=2.0)  # --device cpu: tiny shapes (a CPU worker's first calls are slow)
BERT_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def make_splade(root: str, tokenizer_dir: str, pool: list[str], tiny: bool, device: str) -> str:
    """The SPLADE folder (written once under `root`): a random BertForMaskedLM with the tokenizer,
    wrapped and saved by sentence-transformers' SparseEncoder."""
    import torch
    import transformers as tf
    from sentence_transformers import SparseEncoder

    try:
        from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    except ImportError:  # sentence-transformers 5 names the package models
        from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    path = os.path.join(root, "splade-bert-base-tiny" if tiny else "splade-bert-base")
    if os.path.exists(os.path.join(path, "modules.json")):
        return path
    hf_dir = path + "-mlm"
    os.makedirs(hf_dir, exist_ok=True)
    for name in BERT_TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(hf_dir, name))
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.BertForMaskedLM(tf.BertConfig(**(SPLADE_TINY if tiny else SPLADE_BASE))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms away from 1, as trained ones are
            if name.endswith("LayerNorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        model.cls.predictions.bias.sub_(terms_cut(model, tf.AutoTokenizer.from_pretrained(hf_dir), pool, device))
    model.save_pretrained(hf_dir)
    del model
    SparseEncoder(modules=[MLMTransformer(hf_dir), SpladePooling(pooling_strategy="max")], device="cpu").save(path)
    shutil.rmtree(hf_dir)
    return path


def terms_cut(model, tokenizer, pool: list[str], device: str) -> float:
    """The logit that a text of about 100 tokens has TERMS vocabulary weights above (the median over
    a few texts): subtracted from the MLM bias, it leaves that many positive."""
    import torch

    rng = random.Random(0)
    texts = [" ".join(rng.sample(pool, 8)) for _ in range(8)]
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt").to(device)
    with torch.inference_mode():
        logits = model(**batch).logits.float()
        logits = logits.masked_fill(batch["attention_mask"][..., None] == 0, float("-inf")).amax(dim=1)
        return float(logits.topk(TERMS, dim=1).values[:, -1].median())


def plain_copy(m3_path: str) -> str:
    """The bge-m3 folder without its two heads: the same XLM-R weights, served as a plain embedder
    (CLS pooling, Normalize). Files are hard links where the file system allows."""
    path = m3_path + "-plain"
    if not os.path.exists(os.path.join(path, "modules.json")):
        def link(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        shutil.copytree(m3_path, path, ignore=shutil.ignore_patterns("*.pt"), copy_function=link, dirs_exist_ok=True)
    return path


def server_error(log: str) -> str:
    """The server's own message for its exit: its last ERROR line, else the log's last line."""
    with open(log, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    errors = [m[1] for m in (re.search(r" ERROR [\w.]+: (.*)", line) for line in lines) if m]
    return errors[-1] if errors else (lines[-1] if lines else "no message")


def pollen_runs(paths: dict[str, str], texts: list[str], counts: list[int], device: str, seconds: float,
                runs: list[tuple[str, str, StreamLoad]], may_refuse: bool = False) -> dict:
    """A server for each of `paths` ({server: folder}), all up at once, then each run (server, name,
    load) in order: {name: figures}, a name run several times (the servers in turn) averaged over
    its rounds; or {"refused": message} when a server exits before serving and `may_refuse`."""
    from load.bench_concurrency import server_info
    from tests.conftest import ServerProcess

    servers, logs = {}, {}
    try:
        for key, path in paths.items():
            logs[key] = tempfile.NamedTemporaryFile(prefix=f"pollen-bench-sparse-{key}-", suffix=".log",
                                                    delete=False).name
            servers[key] = ServerProcess("--model", path, "--device", device, "--warmup-seconds", "off",
                                         env={"PYTHONUNBUFFERED": "1"}, log=logs[key])
            try:
                servers[key].start(timeout=900)
            except RuntimeError:
                message = server_error(logs[key])
                if not may_refuse:
                    raise RuntimeError(f"{path}: pollen serve exited before serving: {message}") from None
                print(f"  refused by the server: {message}", flush=True)
                return {"refused": message}
            check_tokens(servers[key].listen, texts, counts)
        rounds: dict[str, list[dict]] = {}
        for key, name, load in runs:
            got = stream_docs(servers[key].listen, texts, "interactive", seconds, load=load)
            got["server_start_s"] = servers[key].started_in_s
            got["server"] = server_info(servers[key].listen)
            if got["errors"] or not got["texts"]:
                raise RuntimeError(f"{paths[key]}, {name}: {got['errors']} errors, {got['texts']} texts answered "
                                   f"(the server's log: {logs[key]})")
            print(f"  pollen, {name}: {got['tokens_per_s']:,.0f} tokens/s, {got['texts_per_s']:,.0f} texts/s",
                  flush=True)
            rounds.setdefault(name, []).append(got)
    finally:
        for server in servers.values():
            server.terminate()
    for log in logs.values():
        os.unlink(log)
    return {name: averaged(got) for name, got in rounds.items()}


def averaged(rounds: list[dict]) -> dict:
    """One load's figures over its rounds: rates averaged, counts summed, each round's rate kept."""
    out = dict(rounds[-1])
    for rate in ("tokens_per_s", "texts_per_s"):
        out[rate] = sum(r[rate] for r in rounds) / len(rounds)
    for count in ("tokens", "texts", "errors"):
        out[count] = sum(r[count] for r in rounds)
    if len(rounds) > 1:
        out["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in rounds]
    return out


def timed(encode, texts: list[str], batch_sizes: tuple[int, ...], device: str, tokens: int, label: str) -> dict:
    """`encode(texts, batch_size)` for every batch size, after a warm-up at that size: tokens/s each."""
    import torch

    out = {}
    for bs in batch_sizes:
        encode(texts[:2 * bs], bs)  # warm-up: kernels chosen, memory pools grown
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        extra = encode(texts, bs)
        if device == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        out[f"bs{bs}"] = {"seconds": secs, "tokens_per_s": tokens / secs, "texts_per_s": len(texts) / secs, **extra}
        print(f"  {label} batch {bs}: {tokens / secs:,.0f} tokens/s", flush=True)
    return out


def splade_reference(path: str, texts: list[str], device: str, limit: int) -> dict:
    """transformers' masked LM and the SPLADE recipe, in bf16 on the GPU (fp32 on the CPU)."""
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForMaskedLM.from_pretrained(path, torch_dtype=dtype).to(device).eval()
    tokens = sum(len(ids) for ids in tokenizer(texts, truncation=True, max_length=limit)["input_ids"])

    @torch.inference_mode()
    def encode(batch_texts: list[str], bs: int) -> dict:
        ordered = sorted(batch_texts, key=len, reverse=True)  # sentence-transformers' order: longest first
        rows, terms = [], 0
        for i in range(0, len(ordered), bs):
            batch = tokenizer(ordered[i:i + bs], padding=True, truncation=True, max_length=limit,
                              return_tensors="pt").to(device)
            logits = model(**batch).logits
            weights = (torch.log1p(torch.relu(logits)) * batch["attention_mask"][..., None]).amax(dim=1)
            rows.append(weights.float().to_sparse().cpu())
            terms += rows[-1].values().numel()
        return {"terms_per_text": terms / len(ordered)}

    out = {"name": f"transformers AutoModelForMaskedLM {'bf16' if device == 'cuda' else 'fp32'} + the SPLADE recipe",
           "tokens": tokens, "texts": len(texts),
           **timed(encode, texts, SPLADE_BATCHES, device, tokens, "transformers SPLADE")}
    release(model, device)
    return out


def m3_reference(path: str, texts: list[str], device: str, limit: int) -> dict:
    """FlagEmbedding's BGEM3FlagModel where it imports, else its recipe in transformers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokens = sum(len(ids) for ids in tokenizer(texts, truncation=True, max_length=limit)["input_ids"])
    try:
        import FlagEmbedding  # noqa: F401
    except Exception as exc:  # not installed, or an install that does not import beside this transformers
        why = "not installed" if isinstance(exc, ModuleNotFoundError) else f"does not import: {exc}"
        name, encode, model = m3_recipe(path, tokenizer, device, limit, why)
    else:
        name, encode, model = flag_m3(path, device, limit)
    out = {"name": name, "tokens": tokens, "texts": len(texts),
           **timed(encode, texts, M3_BATCHES, device, tokens, name.split(" ")[0])}
    release(model, device)
    return out


def flag_m3(path: str, device: str, limit: int):
    from FlagEmbedding import BGEM3FlagModel

    where = "cuda:0" if device == "cuda" else "cpu"
    try:
        model = BGEM3FlagModel(path, use_fp16=device == "cuda", devices=where)
    except TypeError:  # FlagEmbedding before 1.3 names it device
        model = BGEM3FlagModel(path, use_fp16=device == "cuda", device=where)

    def encode(batch_texts: list[str], bs: int) -> dict:
        model.encode(batch_texts, batch_size=bs, max_length=limit, return_dense=True, return_sparse=True,
                     return_colbert_vecs=True)
        return {}

    version = flag_version()
    name = " ".join(filter(None, ("FlagEmbedding", version, "BGEM3FlagModel", "fp16" if device == "cuda" else "fp32")))
    return name, encode, model


def flag_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("FlagEmbedding")
    except metadata.PackageNotFoundError:
        return ""


def m3_recipe(path: str, tokenizer, device: str, limit: int, why: str):
    """FlagEmbedding's BGE-M3 outputs written out with transformers' XLMRobertaModel."""
    import torch
    from transformers import XLMRobertaModel

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = XLMRobertaModel.from_pretrained(path, torch_dtype=dtype, add_pooling_layer=False).to(device).eval()
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    sparse_linear, colbert_linear = torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, hidden)
    sparse_linear.load_state_dict(torch.load(os.path.join(path, "sparse_linear.pt"), weights_only=True))
    colbert_linear.load_state_dict(torch.load(os.path.join(path, "colbert_linear.pt"), weights_only=True))
    sparse_linear.to(device, dtype)
    colbert_linear.to(device, dtype)
    unused = torch.tensor(sorted({i for i in (tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                              tokenizer.unk_token_id) if i is not None}), device=device)

    @torch.inference_mode()
    def encode(batch_texts: list[str], bs: int) -> dict:
        ordered = sorted(batch_texts, key=len, reverse=True)
        dense, lexical, colbert = [], [], []
        for i in range(0, len(ordered), bs):
            batch = tokenizer(ordered[i:i + bs], padding=True, truncation=True, max_length=limit,
                              return_tensors="pt").to(device)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            dense.append(torch.nn.functional.normalize(h[:, 0].float(), dim=-1).cpu())
            weights = torch.relu(sparse_linear(h)).squeeze(-1).float() * mask
            weights = weights.masked_fill(torch.isin(ids, unused), 0)
            per_id = torch.zeros(len(ids), vocab, device=device).scatter_reduce_(1, ids, weights, "amax")
            lexical.append(per_id.to_sparse().cpu())
            vecs = torch.nn.functional.normalize(colbert_linear(h[:, 1:]).float(), dim=-1)
            colbert.extend(vecs[mask[:, 1:].bool()].cpu().split((mask.sum(dim=1) - 1).tolist()))
        return {}

    return (f"transformers XLMRobertaModel {'bf16' if device == 'cuda' else 'fp32'} + FlagEmbedding's heads "
            f"(FlagEmbedding {why})", encode, model)


def release(model, device: str) -> None:
    import torch

    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def versions(device: str) -> dict:
    import sentence_transformers
    import torch
    import transformers

    try:
        import FlagEmbedding  # noqa: F401
        flag = flag_version() or "installed"
    except Exception:
        flag = None
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    return {"device": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__, "flagembedding": flag,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def best(ref: dict) -> tuple[float, int]:
    return max((v["tokens_per_s"], int(k[2:])) for k, v in ref.items() if k.startswith("bs"))


def markdown(meta: dict, rows: list[dict], texts_from: str, seconds: float, device: str) -> str:
    lines = ["| row | model (tokenizer) | texts (mean tokens) | pollen outputs | client | pollen tokens/s | against | "
             "its tokens/s | pollen / against |",
             "| --- | --- | --- | --- | --- | ---: | --- | ---: | ---: |"]
    for r in rows:
        if "reference" in r:
            rate, bs = best(r["reference"])
            theirs = f"{rate:,.0f} (batch {bs})"
        else:
            rate = r["plain"]["tokens_per_s"]
            theirs = f"{rate:,.0f}"
        if r.get("refused"):
            ours, ratio = f"refused by the server: {r['refused']}", "-"
        else:
            ours, ratio = f"{r['pollen']['tokens_per_s']:,.0f}", f"{r['pollen']['tokens_per_s'] / rate:.2f}x"
        lines.append(f"| {r['row']} | {r['model']} ({r['tokenizer']}) | {r['docs']:,} ({r['mean_tokens']:.0f}) | "
                     f"{r['outputs']} | {r['client']} | {ours} | {r['against']} | {theirs} | {ratio} |")
    terms = [r["reference"][f"bs{best(r['reference'])[1]}"].get("terms_per_text") for r in rows if "reference" in r]
    terms_note = "".join(f" The SPLADE reference's rows hold {t:.0f} terms a text on average." for t in terms if t)
    serve = f"pollen serve --model DIR --device {device} --warmup-seconds off"
    flag = f", FlagEmbedding {meta['flagembedding']}" if meta["flagembedding"] else ", FlagEmbedding not imported"
    return (f"{meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}, sentence-transformers "
            f"{meta['sentence_transformers']}{flag}, Python {meta['python']}; {meta['date']}. Random weights in the "
            f"real shapes and formats (load/bench_sparse.py, load/m3_models.py); texts: {texts_from}, sent as text "
            f"(the server tokenizes). pollen: `{serve}`, tokens and texts answered in {seconds:g} s after a warm-up, "
            "through EmbedStream; client: processes x streams, each stream on its own connection keeping messages of "
            "texts in flight. References in the same process after the servers have stopped, every text once at each "
            "batch size; the ratio is against the best. The dense-only row's \"against\" is the same XLM-R weights "
            f"served by pollen as a plain embedder (no heads), on the same texts. {NOTE}{terms_note}\n\n"
            + "\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a smoke run, tiny versions of the shapes and a few texts")
    p.add_argument("--root", default="/tmp/pollen-sparse-ckpt", help="where the checkpoints are written once")
    p.add_argument("--bert-tokenizer", default=os.environ.get("POLLEN_BERT_TOKENIZER_DIR"),
                   help="BERT's uncased WordPiece tokenizer directory, all-MiniLM-L6-v2's (default: "
                        "POLLEN_BERT_TOKENIZER_DIR, else the bundled all-MiniLM-L6-v2's)")
    p.add_argument("--xlmr-tokenizer", default=None,
                   help="XLM-R's tokenizer directory for bge-m3 (default: --bert-tokenizer's, a stand-in)")
    p.add_argument("--stsb", default=None, help="the STS-B test CSV (default: the one tests/data ships)")
    p.add_argument("--docs", type=int, default=None, help="distinct texts per row (default: the row's)")
    p.add_argument("--seconds", type=float, default=None, help="pollen's measured window (default: 10, cpu 1)")
    p.add_argument("--warm", type=float, default=None, help="seconds of load before it (default: the row's, 6-10 s)")
    add_out_argument(p, "sparse")
    args = p.parse_args()
    names = [s for s in args.rows.split(",") if s]
    if set(names) - set(ROWS):
        p.error(f"unknown rows {sorted(set(names) - set(ROWS))}; known: {list(ROWS)}")
    smoke = args.device == "cpu"
    seconds = args.seconds or (1.0 if smoke else 10.0)
    if not args.bert_tokenizer:
        from pollen.common.model_spec import default_model_path

        args.bert_tokenizer = default_model_path()
    m3_tokenizer = args.xlmr_tokenizer or args.bert_tokenizer
    m3_label = (f"given: {m3_tokenizer.rstrip('/').split('/')[-1]}" if args.xlmr_tokenizer
                else "BERT's uncased WordPiece, a stand-in for XLM-R's")

    import torch

    from pollen.common.model_spec import read_model_spec

    build_on = "cuda" if not smoke and torch.cuda.is_available() else "cpu"
    pool, texts_from = sentences(args.stsb)
    os.makedirs(args.root, exist_ok=True)

    def workload(name: str) -> Workload:
        work = SMOKE if smoke else WORKLOADS[name]
        work = dataclasses.replace(work, docs=args.docs) if args.docs else work
        return dataclasses.replace(work, warm=args.warm) if args.warm is not None else work

    def client(work: Workload, outputs: tuple[int, ...]) -> StreamLoad:
        return StreamLoad(processes=1 if smoke else CLIENT_PROCESSES, streams=2 if smoke else STREAMS,
                          window=2 if smoke else IN_FLIGHT, per_message=work.per_message, connection_per_stream=True,
                          warm=work.warm, normalize=True, outputs=outputs)

    def described(load: StreamLoad) -> str:
        return f"{load.processes} x {load.streams} streams, {load.window} x {load.per_message} texts"

    folders = [f for f in ("splade", "m3") if f in names or (f == "m3" and {"bge-m3", "dense"} & set(names))]
    prepared = {}  # every folder and its texts first: a failure shows before the long part
    for folder in folders:
        t0 = time.perf_counter()
        if folder == "splade":
            path = make_splade(args.root, args.bert_tokenizer, pool, smoke, build_on)
        else:
            path = make_bge_m3(args.root, m3_tokenizer, tiny=smoke)
        limit = read_model_spec(path).max_tokens
        texts, counts = make_texts(path, pool, workload("splade" if folder == "splade" else "dense"), limit)
        print(f"{folder}: {path} in {time.perf_counter() - t0:.1f} s; {len(texts)} texts, "
              f"{sum(counts) / len(counts):.0f} tokens on average", flush=True)
        prepared[folder] = (path, limit, texts, counts, {"docs": len(texts), "mean_tokens": sum(counts) / len(counts),
                                                         "tokens": sum(counts), "device": args.device})

    rows = []
    if "splade" in prepared:
        path, limit, texts, counts, common = prepared["splade"]
        load = client(workload("splade"), (pb.OUTPUT_SPARSE,))
        print("splade-bert-base: pollen", flush=True)
        got = pollen_runs({"splade": path}, texts, counts, args.device, seconds, [("splade", "sparse", load)],
                          may_refuse=True)
        with library_defaults():
            ref = splade_reference(path, texts, args.device, limit)
        rows.append({"row": "splade-bert-base", "model": f"BertForMaskedLM, BERT-base {'(tiny)' if smoke else 'shape'}",
                     "tokenizer": "BERT's uncased WordPiece", "outputs": "sparse", "client": described(load),
                     "warm_s": load.warm, "pollen": got.get("sparse"), "refused": got.get("refused"),
                     "against": ref["name"], "reference": ref, **common})
    if "m3" in prepared:
        path, limit, texts, counts, common = prepared["m3"]
        loads, runs = {}, []  # all outputs; then dense only and the plain model in turn, both servers up
        if "bge-m3" in names:
            loads["all"] = client(workload("bge-m3"), (pb.OUTPUT_DENSE, pb.OUTPUT_SPARSE, pb.OUTPUT_TOKENS))
            runs.append(("m3", "all", loads["all"]))
        paths = {"m3": path}
        if "dense" in names:
            loads["dense"] = client(workload("dense"), (pb.OUTPUT_DENSE,))
            paths["plain"] = plain_copy(path)
            plain_load = client(workload("dense"), ())
            runs += [(key, name, load) for _ in range(DENSE_ROUNDS)
                     for key, name, load in (("m3", "dense", loads["dense"]), ("plain", "plain", plain_load))]
        print(f"bge-m3 ({', '.join(loads)}) and its plain copy: pollen", flush=True)
        got = pollen_runs(paths, texts, counts, args.device, seconds, runs)
        plain = got.get("plain")
        m3 = {"model": f"XLM-R-large{' (tiny)' if smoke else ''} + bge-m3's heads", "tokenizer": m3_label}
        if "bge-m3" in names:
            with library_defaults():
                ref = m3_reference(path, texts, args.device, limit)
            rows.append({"row": "bge-m3 all outputs", **m3, "outputs": "dense + sparse + tokens",
                         "client": described(loads["all"]), "warm_s": loads["all"].warm, "pollen": got["all"],
                         "against": ref["name"], "reference": ref, **common})
        if plain is not None:
            rows.append({"row": "bge-m3 dense only", **m3, "outputs": "dense", "client": described(loads["dense"]),
                         "warm_s": loads["dense"].warm, "pollen": got["dense"],
                         "against": "xlm-r-large plain: the same weights without the heads, through pollen",
                         "plain": plain, **common})

    meta = versions(args.device)
    text = markdown(meta, rows, texts_from, seconds, args.device)
    print(text)
    write_result("sparse", device_kind(args.device), "Sparse and multi-output embedders through `pollen serve`, "
                 "against their reference implementations", text, {"meta": meta, "seconds": seconds, "rows": rows},
                 args.out)


if __name__ == "__main__":
    main()
