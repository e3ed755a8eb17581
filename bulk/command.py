"""`pollen bulk IN OUT`: embed a Parquet corpus on Ray Data and write it back as Parquet, every row
with its columns and an `embedding` column (float32, normalized: the server's vectors).

It starts a local Ray instance (or joins one: --ray-address), reads IN (a Parquet file or a
folder of them), embeds with pollen.bulk.ray's actors (one per GPU with --device cuda) and writes
Parquet files into OUT, a new or empty folder. It prints one JSON line: rows, seconds, rows/s.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pollen bulk", description="Embed a Parquet corpus on Ray (in-process "
                                "engine, no server): every row gets an embedding column.")
    p.add_argument("input", help="a Parquet file or a folder of Parquet files")
    p.add_argument("output", help="a new (or empty) folder for the Parquet files written")
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: all-MiniLM-L6-v2); "
                   "on a cluster it must exist on every node")
    p.add_argument("--column", default="text", help="the column of texts to embed [text]")
    p.add_argument("--output-column", default="embedding", help="the column the vectors go to [embedding]")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one actor per GPU [cpu]")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="weights and activations (auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--actors", type=int, default=0, help="model actors (0: one per GPU with cuda, one on cpu)")
    p.add_argument("--cpus-per-actor", type=float, default=0,
                   help="CPUs each actor holds: its torch threads on cpu (0: 1 with cuda; on cpu all the local "
                        "instance's CPUs but one, which reads and writes)")
    p.add_argument("--batch-size", type=int, default=512, help="rows handed to an actor at a time [512]")
    p.add_argument("--max-batch-tokens", type=int, default=0,
                   help="tokens per engine batch (0: 16384 on cuda, 8192 on cpu, or the model's limit if larger)")
    p.add_argument("--truncate", choices=("end", "start", "none"), default="end",
                   help="texts over the model's limit: keep the start (end), keep the end (start), or fail (none)")
    p.add_argument("--dimensions", type=int, default=0, help="Matryoshka prefix length (0: the model's size)")
    p.add_argument("--no-normalize", dest="normalize", action="store_false", help="keep the raw pooled vectors")
    p.add_argument("--prompt-name", default="", help="a prompt the model defines, e.g. query")
    p.add_argument("--prompt", default="", help="a literal prefix for every text")
    p.add_argument("--ray-address", default="", help="an existing Ray cluster (e.g. auto); default: a local "
                   "instance started for this command")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if os.path.isdir(args.output) and os.listdir(args.output):
        print(f"pollen bulk: {args.output} is not empty; give a new or empty folder", file=sys.stderr)
        return 2
    try:
        import ray
        import ray.data
    except ImportError:
        print("pollen bulk needs Ray: pip install 'pollen[ray]'", file=sys.stderr)
        return 2
    from pollen.bulk.ray import embed_dataset

    ray.init(address=args.ray_address or None, include_dashboard=False)
    try:
        started = time.monotonic()
        dataset = embed_dataset(ray.data.read_parquet(args.input), args.model, column=args.column,
                                output=args.output_column, device=args.device, actors=args.actors,
                                cpus_per_actor=args.cpus_per_actor or default_cpus(args.device),
                                batch_size=args.batch_size, **engine_options(args))
        dataset.write_parquet(args.output)
        seconds = time.monotonic() - started
    except Exception as exc:  # Ray has printed the traceback; end with the cause in one line
        print(f"pollen bulk: failed: {root_cause(exc)}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    import pyarrow.dataset

    rows = pyarrow.dataset.dataset(args.output, format="parquet").count_rows()
    print(json.dumps({"rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds, 1),
                      "output": args.output}))
    return 0


def root_cause(exc: BaseException) -> str:
    """The first `SomeError: message` line of the exception's text (Ray's text holds the actor's
    traceback, whose first error is the cause); else the text's last line."""
    lines = str(exc).strip().splitlines()
    errors = [line for line in lines if re.match(r"[A-Za-z_.]*(Error|Exception): ", line)]
    return errors[0] if errors else lines[-1] if lines else type(exc).__name__


def engine_options(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "max_batch_tokens": args.max_batch_tokens, "truncate": args.truncate,
            "dimensions": args.dimensions, "normalize": args.normalize, "prompt_name": args.prompt_name,
            "prompt": args.prompt}


def default_cpus(device: str) -> float:
    """An actor's CPUs: one beside its GPU; on the CPU all but one (Ray Data's reads and writes
    need a CPU of their own, or they wait behind the actor)."""
    import ray

    if device == "cuda":
        return 1
    return max(1, int(ray.cluster_resources().get("CPU", 1)) - 1)
