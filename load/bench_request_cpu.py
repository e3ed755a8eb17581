"""CPU time one request costs each process of the server: the frontend's and the worker's.

    python load/bench_request_cpu.py [--clients 32] [--seconds 8] [--kind unary] [--out load/results/STEM]
                                     [--profile DIR]

A one-layer random BERT (hidden 32) with all-MiniLM-L6-v2's real tokenizer keeps the forward
small, so what is measured is the Python around it: gRPC, admission and tokenization, the rings,
the batcher and the answer. Closed-loop clients (load/load_clients.py) send one short query per
call; the processes' user + system CPU time over the timed window (from /proc), divided by the
requests answered in it, is each one's cost per request. One frontend, one worker.

--profile DIR records the frontend with py-spy over the timed window (DIR/frontend.txt, collapsed
stacks, GIL-idle samples left out) and prints where its time goes: the functions with the most
samples of their own and in all.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import load_clients  # noqa: E402
from load.bench_concurrency import query_texts, versions  # noqa: E402
from load.pyspy_profile import record_profile, summarize_profile  # noqa: E402
from load.results_file import write_results_to  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def small_model() -> str:
    import transformers as tf

    from pollen.common.model_spec import default_model_path

    path = pathlib.Path(tempfile.mkdtemp(prefix="pollen-cpu-cost-"))
    torch.manual_seed(0)
    tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               vocab_size=30522, max_position_embeddings=512)).save_pretrained(str(path))
    shutil.copy(os.path.join(default_model_path(), "tokenizer.json"), path / "tokenizer.json")
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--client-processes", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--kind", default="unary")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    p.add_argument("--profile", default="", help="a folder for the frontend's py-spy profile")
    p.add_argument("--native", action="store_true", help="the profile with native frames (slows the run)")
    args = p.parse_args()
    server = ServerProcess("--model", small_model(), "--log-level", "WARNING", "--worker-threads", "1").start()
    try:
        children = {pid: open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode()
                    for pid in server.child_pids()}
        texts = query_texts()
        marks: dict = {}
        warm = 2.0

        def mark() -> None:  # CPU times at the window's edges, as the clients measure it
            time.sleep(1.5 + warm)
            marks["start"] = {pid: cpu_seconds(pid) for pid in children}
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                frontend = next(pid for pid, title in children.items() if "frontend" in title)
                marks["spy"] = record_profile(frontend, args.seconds, os.path.join(args.profile, "frontend.txt"),
                                              native=args.native)
            time.sleep(args.seconds)
            marks["end"] = {pid: cpu_seconds(pid) for pid in children}

        sampler = threading.Thread(target=mark)
        sampler.start()
        load = load_clients.run(args.kind, server.listen, server.http_listen, args.clients, args.client_processes,
                                texts, warm, args.seconds)
        sampler.join()
    finally:
        server.terminate()
    # Process titles without the model's temporary folder name, so runs compare line by line.
    cost = {title.split(" cpu ")[0] if "worker" in title else title:
            (marks["end"][pid] - marks["start"][pid]) / max(1, load["completed"]) * 1e6
            for pid, title in children.items()}
    result = {"meta": versions(), "label": args.label, "load": load, "cpu_us_per_request": cost}
    print(result, flush=True)
    profile = ""
    if args.profile:
        marks["spy"].wait()
        profile = summarize_profile(os.path.join(args.profile, "frontend.txt"))
        print(profile, flush=True)
    if args.out:
        m = result["meta"]
        head = (f"# CPU time per request, {m['date']}{' — ' + args.label if args.label else ''}\n\n"
                f"{m['cores']} cores, torch {m['torch']}, grpcio {m['grpcio']}, Python {m['python']}. Command: "
                f"`python load/bench_request_cpu.py --clients {args.clients} --kind {args.kind} --seconds "
                f"{args.seconds}{' --profile DIR' if profile else ''}`; {load['queries_per_s']:,.0f} requests/s, p50 "
                f"{load['p50_ms']:.2f} ms.\n\n")
        table = "| process | CPU µs per request |\n| --- | --- |\n" + "".join(
            f"| {title} | {us:,.0f} |\n" for title, us in sorted(cost.items()))
        if profile:
            table += "\nThe frontend's samples by function (py-spy, GIL-idle samples left out):\n\n" + profile
        write_results_to(args.out, result, head, table)


if __name__ == "__main__":
    main()
