"""bench_rerank --tokenize: tokenizing a rerank call's documents, the tokenizers library against
tokie, and tokie's fan-out.

    python load/bench_rerank.py --tokenize --bert-tokenizer DIR --qwen3-tokenizer tokenizer.json
           [--fan-outs 1,2,4,8,0] [--callers 1,4,8] [--seconds 3]

The texts are load/bench_rerank.py's: 100 documents of about 200 tokens (about 110,000
characters), the documents of one Rerank call. Each row times one call that makes all their pairs
with a short query, by the frontend's own code (server/tasks/rerank.py `PairBuilder.frame`, then
`PairFrame`; the Qwen3 tokenizer's pairs in Qwen3-Reranker's prompt):

  tokenizers library   PairFrame.pairs with TextTokenizer(tokie=False), on the calling thread (a
                       frontend sets TOKENIZERS_PARALLELISM=false: server/process/supervisor.py FRONTEND_ENV),
                       as --tokie off does
  tokie                PairFrame.tokie_pairs with TextTokenizer(tokie=True): the tokie check of
                       server/pipeline/tokie_ids.py, one tokie call, the pairs in one array

tokie runs a call of many texts on as many threads as the calling thread may use cores (its CPU
affinity), spawned for the call. `fan-out` is that many cores (0: every core the process may use),
set on each calling thread. `callers` threads make such calls at once, each on its own window of
cores (as frontends do under a rerank load): p50 and p99 of one call, and the characters
tokenized per second by all of them together.
Writes load/results/tokenize-<kind>.md (load/results_file.py; <kind> is the host's GPU, if any).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.results_file import device_kind, write_result  # noqa: E402

SECONDS = 3.0
LIMIT = 512  # a pair's tokens
QUERY = "how do bees make honey"  # beside every document


def pair_frame(tokenizer, qwen3: bool):
    """What the pairs of a request share, as a frontend makes it for QUERY under LIMIT: a
    cross-encoder's pair form, or Qwen3-Reranker's prompt (server/tasks/rerank.py PairBuilder.frame)."""
    from types import SimpleNamespace

    from pollen.server.tasks.rerank import PairBuilder
    from pollen.v1 import embedder_pb2 as pb

    spec = SimpleNamespace(reranker_template=qwen3, type_offset=0)
    return PairBuilder(spec, tokenizer).frame(QUERY, "", LIMIT, pb.TRUNCATE_END)


def tokenize(frame, tokenizer, docs: list[str]) -> None:
    """One call's work, as a frontend's tokenizer thread does it for a Rerank call's documents."""
    if tokenizer.tokie is not None:
        mine, _ = frame.tokie_pairs(tokenizer, docs)
        assert len(mine) == len(docs), "a document left to the tokenizers library: the row would mix the two"
    else:
        frame.pairs(tokenizer, docs)


def timed_calls(frame, tokenizer, docs: list[str], fan_out: int, callers: int, seconds: float = SECONDS) -> dict:
    """`callers` threads tokenize `docs` again and again for `seconds`, each on `fan_out` cores
    of its own window (0: every core): per-call p50 and p99 in ms, characters per second in all."""
    cores = sorted(os.sched_getaffinity(0))
    times: list[list[float]] = [[] for _ in range(callers)]
    start = threading.Barrier(callers + 1)
    stop = threading.Event()

    def caller(j: int) -> None:
        if fan_out:
            os.sched_setaffinity(0, [cores[(j * fan_out + k) % len(cores)] for k in range(fan_out)])
        for _ in range(3):
            tokenize(frame, tokenizer, docs)
        start.wait()
        while not stop.is_set():
            t0 = time.perf_counter()
            tokenize(frame, tokenizer, docs)
            times[j].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=caller, args=(j,)) for j in range(callers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    ms = np.concatenate([np.asarray(t) for t in times]) * 1e3
    chars = sum(map(len, docs)) * len(ms)
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "calls": len(ms),
            "mchars_per_s": chars / elapsed / 1e6}


def add_arguments(p) -> None:
    """bench_rerank's flags for this study (its --bert-tokenizer and --qwen3-tokenizer serve too)."""
    p.add_argument("--fan-outs", default="1,2,4,8,0", help="--tokenize: cores each tokie call may use (0: all)")
    p.add_argument("--callers", default="1,4,8", help="--tokenize: threads tokenizing at once")
    p.add_argument("--seconds", type=float, default=SECONDS, help="--tokenize: seconds a row")


def run(args, docs: list[str]) -> None:
    """The study on one Rerank call's documents; writes tokenize-<kind>.md (or args.out)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as in a frontend
    from pollen.server.pipeline.tokenizer import TextTokenizer

    fan_outs = [int(x) for x in args.fan_outs.split(",")]
    callers = [int(x) for x in args.callers.split(",")]
    cores = len(os.sched_getaffinity(0))
    rows = []
    qwen3_dir = tempfile.mkdtemp(prefix="pollen-qwen3-tokenizer-")
    shutil.copy(args.qwen3_tokenizer, os.path.join(qwen3_dir, "tokenizer.json"))
    for name, path, qwen3 in (("BERT WordPiece (all-MiniLM-L6-v2)", args.bert_tokenizer, False),
                              ("Qwen3 byte-level BPE", qwen3_dir, True)):
        for tokie in (False, True):
            tokenizer = TextTokenizer(path, 1 << 20, tokie=tokie)
            frame = pair_frame(tokenizer, qwen3)
            for n in callers:
                for fan_out in (fan_outs if tokie else [0]):
                    row = {"tokenizer": name, "library": "tokie" if tokie else "tokenizers",
                           "fan_out": (fan_out or cores) if tokie else 1, "callers": n,
                           **timed_calls(frame, tokenizer, docs, fan_out, n, args.seconds)}
                    print(row, flush=True)
                    rows.append(row)
    lines = ["| tokenizer | library | cores a call may use | callers at once | call p50 ms | call p99 ms | "
             "M chars/s in all |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        fan = r["fan_out"] if r["library"] == "tokie" else 1
        lines.append(f"| {r['tokenizer']} | {r['library']} | {fan} | {r['callers']} | {r['p50_ms']:.2f} | "
                     f"{r['p99_ms']:.2f} | {r['mchars_per_s']:.1f} |")
    text = (f"One call tokenizes the {len(docs)} documents of a Rerank call ({sum(map(len, docs)):,} characters, "
            f"about 200 tokens each) into pairs as a frontend does (server/tasks/rerank.py PairFrame.tokie_pairs, "
            f"or PairFrame.pairs for the tokenizers library); {cores} cores. "
            f"Each caller thread may use `cores a call may use` cores (its CPU affinity, a window of its own), "
            f"which is as many threads as tokie spawns for the call.\n\n" + "\n".join(lines))
    print(text)
    write_result("tokenize", device_kind(), "Tokenizing a rerank call's documents", text,
                 {"rows": rows, "cores": cores}, args.out)

