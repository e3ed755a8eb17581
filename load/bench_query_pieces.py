"""A query's per-call pieces in a tight loop: tokenization (HF tokenizers against the tiktoken
path of server/ascii_bpe.py), its request record (the struct shortcut against the general path),
and the worker's batcher taking it alone (add, then next_batch: worker/batcher.py).

    python load/bench_query_pieces.py --tokenizer TOKENIZER.json [--calls 20000] [--out load/results/STEM]

The queries are load/bench_concurrency.py's (12-13 Qwen3 tokens). Each row is the mean µs a call
over --calls calls, best of --repeats runs. These are tight-loop figures: in a busy frontend each
piece costs several times as much (load/bench_frontend_floor.py measures it in place).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load.bench_concurrency import query_texts, versions  # noqa: E402
from load.results_file import write_results_to  # noqa: E402


def best_us(fn, items: list, calls: int, repeats: int) -> float:
    """Mean µs of fn(item) over `calls` calls cycling through `items`, the best of `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for i in range(calls):
            fn(items[i % len(items)])
        best = min(best, (time.perf_counter() - began) / calls * 1e6)
    return best


def measure(tokenizer_json: str, calls: int, repeats: int) -> dict:
    from pollen.server.tokenizer import TextTokenizer
    from pollen.shared_mem import records
    from pollen.v1 import embedder_pb2 as pb
    from pollen.worker.batcher import Batcher, Job
    from pollen.worker.engine import INTERACTIVE

    model = tempfile.mkdtemp(prefix="pollen-pieces-")
    shutil.copy(tokenizer_json, os.path.join(model, "tokenizer.json"))
    fast, slow = TextTokenizer(model, 8192), TextTokenizer(model, 8192, tiktoken=False)
    if fast.ascii_bpe is None:
        raise SystemExit(f"{tokenizer_json}: tiktoken does not reproduce this tokenizer (server/ascii_bpe.py)")
    texts = query_texts()
    seqs32 = [fast.encode([t], pb.TRUNCATE_NONE)[0] for t in texts]
    seqs64 = [s.astype(np.int64) for s in seqs32]  # the general path of encode_request
    recs = [records.decode_request(memoryview(records.encode_request(1, 0, [s], 0, True, 0))) for s in seqs32]
    batcher = Batcher(16384)

    def lone_query(rec) -> None:
        batcher.add(Job.of(rec))
        batcher.next_batch(INTERACTIVE)

    return {
        "hf tokenizer (TextTokenizer, --tiktoken off)":
            best_us(lambda t: slow.encode([t], pb.TRUNCATE_NONE), texts, calls, repeats),
        "tiktoken path (TextTokenizer, --tiktoken on)":
            best_us(lambda t: fast.encode([t], pb.TRUNCATE_NONE), texts, calls, repeats),
        "request record, general path (numpy)":
            best_us(lambda s: records.encode_request(1, 0, [s], 0, True, 0), seqs64, calls, repeats),
        "request record, one int32 sequence (struct)":
            best_us(lambda s: records.encode_request(1, 0, [s], 0, True, 0), seqs32, calls, repeats),
        "worker: the batcher takes a lone query (Job.of, add, next_batch)": best_us(lone_query, recs, calls, repeats),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True, help="a byte-level BPE tokenizer.json (the real Qwen3 one)")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    figures = measure(args.tokenizer, args.calls, args.repeats)
    table = "\n".join(["| piece | µs a call |", "| --- | ---: |"] +
                      [f"| {name} | {us:.2f} |" for name, us in figures.items()]) + "\n"
    print(table)
    if args.out:
        m = versions()
        head = (f"# A query's pieces in a tight loop, {m['date']}\n\n{m.get('gpu', 'CPU')} machine, {m['cores']} cores, "
                f"Python {m['python']}; tokenizer {os.path.basename(args.tokenizer)}. Command: `python "
                f"load/bench_query_pieces.py --tokenizer TOKENIZER.json --calls {args.calls}`.\n\n")
        write_results_to(args.out, {"meta": m, "us_per_call": figures}, head, table)


if __name__ == "__main__":
    main()
