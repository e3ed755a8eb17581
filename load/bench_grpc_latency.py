"""gRPC's own round trip for one call at a time, by server kind, client kind, transport and gRPC
core settings: what each of gRPC's two Python ends costs a lone query, and which settings shorten it.

    python load/bench_grpc_latency.py [--tokenizer TOKENIZER.json] [--calls 3000] [--rounds 2] [--variants default,iomgr]
                                      [--servers grpc,grpc-sync] [--clients sync,aio]
                                      [--transports tcp,unix] [--out load/results/STEM]

The servers are load/bench_frontend_floor.py's stand-ins (`grpc`: grpc.aio as pollen's frontend
serves, with its options; `grpc-sync`: grpcio's threaded server), answering a fixed vector of the
model's width at once. The client, load/bench_one_client.py's (grpc's blocking stub, or grpc.aio's
on uvloop), sends the queries of load/bench_concurrency.py one after the other, each after the last
answer, after its warm-up. Server and client are
separate processes started with the variant's environment (gRPC reads it at import):

  default   gRPC as installed
  iomgr     GRPC_EXPERIMENTS turning off the EventEngine client, listener, endpoints and
            callback completion queue (the iomgr path, where the thread that waits on a completion
            queue polls the socket itself instead of being woken by an EventEngine thread)
  iomgr-server, iomgr-client   the same on one side only
  poll      GRPC_POLL_STRATEGY=poll
  iomgr-poll both

Every cell alternates over --rounds; the table gives each cell's p50 and p99 (medians over rounds).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pollen.server.grpc_core import IOMGR_EXPERIMENTS  # noqa: E402  (the frontends' own setting)

_IOMGR = {"GRPC_EXPERIMENTS": IOMGR_EXPERIMENTS}
_POLL = {"GRPC_POLL_STRATEGY": "poll"}
# name -> (the server's environment, the client's)
VARIANTS = {
    "default": ({}, {}),
    "iomgr": (_IOMGR, _IOMGR),
    "iomgr-server": (_IOMGR, {}),
    "iomgr-client": ({}, _IOMGR),
    "poll": (_POLL, _POLL),
    "iomgr-poll": (_IOMGR | _POLL, _IOMGR | _POLL),
}


def client(kind: str, target: str, calls: int) -> None:
    """Run one of load/bench_one_client.py's clients (its warm-up, then `calls` timed calls); print
    its figures as JSON."""
    from load.bench_concurrency import query_texts
    from load.bench_one_client import RUN

    print(json.dumps(RUN[kind](target, query_texts(), calls)))


def one_cell(server: str, client_kind: str, transport: str, variant: str, model: str, calls: int) -> dict:
    from tests.conftest import free_port

    server_env, client_env = (os.environ | side for side in VARIANTS[variant])
    sock_dir = tempfile.mkdtemp(prefix="pollen-grpc-lat-")
    listen = f"unix:{sock_dir}/s.sock" if transport == "unix" else f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, str(REPO / "load/bench_frontend_floor.py"), "--serve", server, listen,
                             model], stdout=subprocess.PIPE, env=server_env)
    try:
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the {server} server did not start")
        out = subprocess.run([sys.executable, __file__, "--client", client_kind, listen, str(calls)], env=client_env,
                             capture_output=True, check=True).stdout
    finally:
        proc.kill()
        proc.wait()
    figures = json.loads(out)
    return {"server": server, "client": client_kind, "transport": transport, "variant": variant,
            "calls": figures["calls"], "p50_ms": figures["p50_ms"], "p99_ms": figures["p99_ms"]}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--client":
        return client(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--servers", default="grpc,grpc-sync")
    p.add_argument("--clients", default="sync,aio")
    p.add_argument("--transports", default="tcp,unix")
    p.add_argument("--tokenizer", default="", help="a Qwen3 tokenizer.json (default: all-MiniLM-L6-v2's model)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    from load.bench_frontend_floor import model_dir

    model = model_dir(args.tokenizer)
    cells = list(itertools.product(args.servers.split(","), args.clients.split(","), args.transports.split(","),
                                   args.variants.split(",")))
    runs = []
    for r in range(args.rounds):
        for cell in cells:
            runs.append(one_cell(*cell, model, args.calls) | {"round": r})
            row = runs[-1]
            print(f"round {r} {' '.join(cell):40s} p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms", flush=True)
    table = table_of(runs, cells)
    print(table)
    if args.out:
        from load.bench_concurrency import versions
        from load.results_file import write_results_to

        m = versions()
        command = " ".join(["python load/bench_grpc_latency.py"] + sys.argv[1:])
        head = (f"# gRPC's round trip, one call at a time, {m['date']}\n\n{m['cores']} cores, grpcio {m['grpcio']}, "
                f"Python {m['python']}. Command: `{command}`. Medians over {args.rounds} rounds of "
                f"{args.calls} calls each.\n\n")
        write_results_to(args.out, {"meta": m, "runs": runs}, head, table)


def table_of(runs: list[dict], cells: list[tuple]) -> str:
    rows = ["| server | client | transport | variant | p50 ms | p99 ms | p50 each round |",
            "| --- | --- | --- | --- | ---: | ---: | --- |"]
    for cell in cells:
        mine = [r for r in runs if (r["server"], r["client"], r["transport"], r["variant"]) == cell]
        p50 = statistics.median(r["p50_ms"] for r in mine)
        p99 = statistics.median(r["p99_ms"] for r in mine)
        each = ", ".join(f"{r['p50_ms']:.3f}" for r in mine)
        rows.append(f"| {' | '.join(cell)} | {p50:.3f} | {p99:.3f} | {each} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
