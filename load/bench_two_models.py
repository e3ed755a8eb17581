"""An embedder and a reranker in one server: what the reranker costs the embedder's queries.

    python load/bench_two_models.py --qwen3-tokenizer tokenizer.json --bert-tokenizer DIR
           [--embedder qwen3-0.6b] [--reranker bge-reranker-v2-m3] [--calls 1000] [--rounds 2]

Two servers, started one after the other on the same GPU (random weights in the real shapes,
load/gpu_models.py and load/rerank_models.py; the real tokenizers):

  alone     `pollen serve --model E`
  together  `pollen serve --model E --model R`

For each, one client sends --calls queries one after the other (grpc's blocking stub, 12-13
Qwen3 tokens each, as load/bench_one_client.py): p50 and p99. The pair is started --rounds times,
alone then together, and each together server is compared with the alone one started just before
it (a server's figures move from one start to the next by about as much as the reranker costs).
In the last together server the queries are then measured under a saturating rerank load:
LOAD_CLIENTS processes each keep LOAD_IN_FLIGHT Rerank calls of 1 query x 100 documents of about
200 tokens in flight, at the interactive priority (the default) twice, then at the bulk priority;
the rerank pairs/s they got is given beside, and the CUDA graphs the workers captured during each measurement (/metrics).
Each query's worker part (its answer's timing: admission to its batch's end) is given beside its
total, to tell the worker's wait from the frontend's and the transport's.
Writes load/results/two_models-<kind>.md (load/results_file.py).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.bench_concurrency import query_texts  # noqa: E402
from load.bench_rerank import DOCS, workload  # noqa: E402
from load.gpu_models import make_checkpoint, with_tokenizer  # noqa: E402
from load.rerank_models import make_reranker  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402

LOAD_CLIENTS, LOAD_IN_FLIGHT = 2, 4
WARM_CALLS = 200


def query_latency(target: str, calls: int) -> dict:
    """One client's queries, one after the other: p50 and p99 in ms, and of the worker's part of
    each (its answer's timing: admission to its batch's end, queue_us + inference_us)."""
    import grpc

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    texts = query_texts(calls + WARM_CALLS)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        for text in texts[:WARM_CALLS]:
            stub.Embed(pb.EmbedRequest(texts=[text], normalize=True), timeout=30)
        times, worker = [], []
        for text in texts[WARM_CALLS:]:
            t0 = time.perf_counter()
            reply = stub.Embed(pb.EmbedRequest(texts=[text], normalize=True), timeout=30)
            times.append(time.perf_counter() - t0)
            worker.append((reply.timing.queue_us + reply.timing.inference_us) / 1e3)
    ms = np.asarray(times) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "worker_p50_ms": float(np.percentile(worker, 50)), "worker_p99_ms": float(np.percentile(worker, 99))}


def graphs_held(http_target: str) -> int:
    """The CUDA graphs the server's workers hold (its /metrics): a rise over a measurement means
    captures ran during it."""
    from load.server_metrics import settled_samples

    return int(sum(s.value for s in settled_samples(http_target) if s.name == "pollen_worker_graphs"))


def rerank_load(target: str, priority: int, stop, pairs) -> None:
    """One load process: LOAD_IN_FLIGHT Rerank calls in flight until `stop` is set; adds the pairs answered."""
    import grpc

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    queries, docs = workload()

    async def run() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EmbedderStub(channel)

            async def caller(k: int) -> None:
                i = k
                while not stop.is_set():
                    q = i % len(queries)
                    await stub.Rerank(pb.RerankRequest(query=queries[q], documents=docs[q * DOCS:(q + 1) * DOCS],
                                                       priority=priority), timeout=120)
                    with pairs.get_lock():
                        pairs.value += DOCS
                    i += LOAD_IN_FLIGHT

            await asyncio.gather(*(caller(k) for k in range(LOAD_IN_FLIGHT)))

    asyncio.run(run())


def under_rerank_load(target: str, calls: int, priority: int) -> dict:
    """query_latency while LOAD_CLIENTS processes keep the reranker saturated; and their pairs/s."""
    ctx = multiprocessing.get_context("spawn")
    stop, pairs = ctx.Event(), ctx.Value("q", 0)
    procs = [ctx.Process(target=rerank_load, args=(target, priority, stop, pairs)) for _ in range(LOAD_CLIENTS)]
    for proc in procs:
        proc.start()
    time.sleep(5)  # the load reaches its steady state (the reranker's graphs, the queues)
    start_pairs, t0 = pairs.value, time.perf_counter()
    figures = query_latency(target, calls)
    figures["rerank_pairs_per_s"] = (pairs.value - start_pairs) / (time.perf_counter() - t0)
    stop.set()
    for proc in procs:
        proc.join(timeout=180)
    return figures


def main() -> None:
    from pollen.v1 import embedder_pb2 as pb
    from tests.conftest import ServerProcess

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--embedder", default="qwen3-0.6b")
    p.add_argument("--reranker", default="bge-reranker-v2-m3")
    p.add_argument("--qwen3-tokenizer", required=True, help="the real Qwen3 tokenizer.json")
    p.add_argument("--bert-tokenizer", required=True, help="a BERT tokenizer directory (the MiniLM one)")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2, help="alone and together servers started in turn, each "
                   "measured quiet (the rerank loads run in the last together server)")
    add_out_argument(p, "two_models")
    args = p.parse_args()
    embedder = with_tokenizer(make_checkpoint(args.embedder, args.root), args.qwen3_tokenizer)
    reranker = make_reranker(args.reranker, args.root, args.bert_tokenizer, args.qwen3_tokenizer)
    rows = []
    common = ("--device", "cuda", "--warmup-seconds", "20")
    for r in range(1, args.rounds + 1):
        srv = ServerProcess("--model", embedder, *common).start(timeout=900)
        try:
            rows.append({"round": r, "server": "embedder alone", "load": "none", **query_latency(srv.listen, args.calls)})
        finally:
            srv.terminate()
        srv = ServerProcess("--model", embedder, "--model", reranker, *common).start(timeout=900)
        try:
            rows.append({"round": r, "server": "embedder + reranker", "load": "none",
                         **query_latency(srv.listen, args.calls)})
            loads = (("interactive", pb.PRIORITY_INTERACTIVE), ("interactive, again", pb.PRIORITY_INTERACTIVE),
                     ("bulk", pb.PRIORITY_BULK))
            for name, priority in loads if r == args.rounds else ():
                before = graphs_held(srv.http_listen)
                row = {"round": r, "server": "embedder + reranker", "load": f"rerank, {name}",
                       **under_rerank_load(srv.listen, args.calls, priority)}
                rows.append({**row, "graphs_captured": graphs_held(srv.http_listen) - before})
        finally:
            srv.terminate()
    for row in rows:
        print(row, flush=True)
    alone = {r["round"]: r for r in rows if r["server"] == "embedder alone"}
    lines = ["| round | server | load | query p50 ms | query p99 ms | p50 / alone | p99 / alone | "
             "worker's part p50 / p99 ms | graphs captured meanwhile | rerank pairs/s |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = alone[r["round"]]
        r["p50_over_alone"], r["p99_over_alone"] = r["p50_ms"] / base["p50_ms"], r["p99_ms"] / base["p99_ms"]
        pairs = f"{r['rerank_pairs_per_s']:,.0f}" if "rerank_pairs_per_s" in r else "-"
        lines.append(f"| {r['round']} | {r['server']} | {r['load']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                     f"{r['p50_over_alone']:.2f} | {r['p99_over_alone']:.2f} | "
                     f"{r['worker_p50_ms']:.2f} / {r['worker_p99_ms']:.2f} | {r.get('graphs_captured', '-')} | {pairs} |")
    quiet = [r["p50_over_alone"] for r in rows if r["server"] != "embedder alone" and r["load"] == "none"]
    text = (f"Embedder {args.embedder} (real Qwen3 tokenizer), reranker {args.reranker}, random weights, bf16. "
            f"One client's {args.calls} queries one after the other; the rerank load: {LOAD_CLIENTS} processes x "
            f"{LOAD_IN_FLIGHT} Rerank calls of 1 x {DOCS} documents (~200 tokens) in flight. Each row is compared "
            f"with the alone server of its round; the quiet p50 / alone over the {args.rounds} rounds: "
            f"{', '.join(f'{q:.2f}' for q in quiet)} (median {float(np.median(quiet)):.2f}).\n\n" + "\n".join(lines))
    print(text)
    write_result("two_models", device_kind(), "An embedder and a reranker in one server", text,
                 {"rows": rows, "embedder": args.embedder, "reranker": args.reranker,
                  "quiet_p50_over_alone_median": float(np.median(quiet))}, args.out)


if __name__ == "__main__":
    main()
