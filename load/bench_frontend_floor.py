"""Where a frontend's CPU per unary query goes: gRPC's own share, the tokenizer's, and pollen's.

    python load/bench_frontend_floor.py [--tokenizer TOKENIZER.json] [--rounds 3] [--seconds 6]
                                        [--clients 32] [--out load/results/STEM]

Five servers, one after the other and alternating over --rounds, each answering the same
closed-loop unary clients (load/load_clients.py, one short query a call); each one's figure is its
process's CPU time over the timed window divided by the calls answered in it:

  grpc-sync grpcio's threaded (synchronous) server of pollen's proto, with the frontend's server
            options and a pool of SYNC_THREADS threads, whose Embed answers a fixed vector at once:
            the floor without asyncio (pollen's frontends are grpc.aio: its streams, deadlines and
            rings live on an event loop)
  grpc      the same on grpc.aio, as pollen's frontend serves (server/frontend.py): what any
            grpc.aio frontend pays per call
  tokenize  the same, tokenizing the call's text first with the model's tokenizer.json
  service   pollen's own EmbedderService and Admission (checks, tokenization, the request record
            encoded, metrics in multiprocess mode, the answer built) with a router that answers at
            once: a frontend without its rings and its worker
  pollen    a real `pollen serve` frontend (one frontend; its worker runs a one-layer model)

With two or more cores, the server under test runs on the first and the clients on the others, so
the clients' work does not land on the server's core (a `pollen serve` worker is moved beside the
clients; its time is not counted). The model is a one-layer random checkpoint with a real tokenizer:
all-MiniLM-L6-v2's (a BERT), or with --tokenizer a Qwen3 tokenizer.json (a qwen3-tiny checkpoint).
From `grpc` on, the difference between consecutive rows is what each layer adds (`grpc` over
`grpc-sync` is what asyncio's server costs over the threaded one); on a 2-core machine a row moves
by about 10% from one round to the next, so take the medians.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import load_clients  # noqa: E402
from load.bench_concurrency import query_texts, versions  # noqa: E402
from load.results_file import write_results_to  # noqa: E402
from tests.conftest import ServerProcess, free_port  # noqa: E402

KINDS = ("grpc-sync", "grpc", "tokenize", "service", "pollen")
SYNC_THREADS = 16  # grpc-sync's handler threads: more than the clients' connections


def serve(kind: str, listen: str, model: str) -> None:
    """One of the stand-in servers (`grpc-sync`, `grpc`, `tokenize`, `service`), until killed."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as a frontend runs (server/tokenizer.py)
    if kind == "service":  # metrics as `pollen serve` counts them, before prometheus_client is imported
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="pollen-floor-metrics-")
    if kind == "grpc-sync":
        return _serve_sync(listen, model)
    import uvloop

    uvloop.run(_serve(kind, listen, model))


def _fixed_answer(model: str):
    """(dims, body): the vector the stand-ins answer with."""
    import numpy as np

    from pollen.common.model_spec import read_model_spec

    dims = read_model_spec(model).hidden_size
    return dims, np.random.default_rng(0).standard_normal(dims).astype(np.float32).tobytes()


def _serve_sync(listen: str, model: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from pollen.server.config import ServeConfig
    from pollen.server.frontend import grpc_options
    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    dims, body = _fixed_answer(model)
    server = grpc.server(ThreadPoolExecutor(SYNC_THREADS), options=grpc_options(ServeConfig(model=model)))

    class Fixed(pb_grpc.EmbedderServicer):
        def Embed(self, request, context):
            return pb.EmbedResponse(id=request.id, embeddings=body, rows=1, dims=dims)

    pb_grpc.add_EmbedderServicer_to_server(Fixed(), server)
    server.add_insecure_port(listen)
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


async def _serve(kind: str, listen: str, model: str) -> None:
    import grpc

    from pollen.server.config import ServeConfig
    from pollen.server.frontend import grpc_options, grpc_server
    from pollen.shared_mem import records
    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    cfg = ServeConfig(model=model)
    dims, body = _fixed_answer(model)
    if kind == "service":
        server, _ = grpc_server(cfg, _service(cfg, _InstantRouter(records, dims, body)), listen)
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.path.join(model, "tokenizer.json")) if kind == "tokenize" else None
        server = grpc.aio.server(options=grpc_options(cfg))

        class Fixed(pb_grpc.EmbedderServicer):
            async def Embed(self, request, context):
                if tokenizer is not None:
                    tokenizer.encode_batch_fast([request.texts[0]])
                return pb.EmbedResponse(id=request.id, embeddings=body, rows=1, dims=dims)

        pb_grpc.add_EmbedderServicer_to_server(Fixed(), server)
        server.add_insecure_port(listen)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def _service(cfg, router):
    from concurrent.futures import ThreadPoolExecutor

    from pollen.server.admission import Admission
    from pollen.server.served_model import served_spec
    from pollen.server.service import EmbedderService
    from pollen.server.tokenizer import TextTokenizer

    spec = served_spec(cfg)
    admission = Admission(spec, TextTokenizer(cfg.model, spec.max_tokens), ThreadPoolExecutor(1),
                          cfg.max_texts_per_request, cfg.default_truncate)
    return EmbedderService(cfg, spec, admission, router)


class _InstantRouter:
    """Router.embed's record encoding, then an answer at once (no ring, no worker)."""

    def __init__(self, records, dims: int, body: bytes):
        self.records, self.dims, self.body = records, dims, body

    async def embed(self, seqs, dims, normalize, encoding, *, rows=None, priority=0, deadline_ns=0):
        self.records.encode_request(1, 0, seqs, dims, normalize, encoding, deadline_ns=deadline_ns,
                                    priority=priority, rows=rows)
        return self.records.ResultRecord(1, self.records.OK, 1, self.dims, encoding, 5, 50, self.body)


def model_dir(tokenizer: str) -> str:
    root = tempfile.mkdtemp(prefix="pollen-floor-")
    if tokenizer:
        from load.gpu_models import make_checkpoint, with_tokenizer

        return with_tokenizer(make_checkpoint("qwen3-tiny", root), tokenizer)
    from load.bench_request_cpu import small_model

    return small_model()


def measure(kind: str, model: str, texts: list[str], args) -> dict:
    """One server of `kind` on the server core, loaded by the clients on the others."""
    cores = sorted(os.sched_getaffinity(0))
    server_cores, client_cores = (cores[:1], cores[1:]) if len(cores) > 1 else (cores, cores)
    listen = f"127.0.0.1:{free_port()}"
    os.sched_setaffinity(0, server_cores)  # what the server inherits
    try:
        if kind == "pollen":
            server = ServerProcess("--model", model, "--log-level", "WARNING", "--worker-threads", "1",
                                   listen=listen).start()
            titles = {pid: open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0] for pid in server.child_pids()}
            pids = [pid for pid, title in titles.items() if b"frontend" in title]
            for pid in set(titles) - set(pids):  # the worker's threads beside the clients: the frontend's core is its own
                for task in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(task), client_cores)
            stop = server.terminate
        else:
            proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, listen, model], stdout=subprocess.PIPE)
            if proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"the {kind} server did not start")
            pids, stop = [proc.pid], lambda: (proc.kill(), proc.wait())
    finally:
        os.sched_setaffinity(0, client_cores)  # what the clients inherit
    try:
        load = load_clients.run("unary", listen, "", args.clients, args.client_processes, texts, 2.0, args.seconds,
                                watch={"server": pids})
    finally:
        stop()
        os.sched_setaffinity(0, cores)
    calls = max(1.0, load["queries_per_s"])
    return {"kind": kind, "calls_per_s": load["queries_per_s"], "p50_ms": load["p50_ms"], "errors": load["errors"],
            "server_us": load["cores_busy"]["server"] / calls * 1e6,
            "clients_us": load["cores_busy"]["clients"] / calls * 1e6}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        return serve(*sys.argv[2:])
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", default="", help="a Qwen3 tokenizer.json (default: all-MiniLM-L6-v2's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--client-processes", type=int, default=1)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--out", default="")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    model, texts = model_dir(args.tokenizer), query_texts()
    runs = []
    for r in range(args.rounds):
        for kind in kinds:
            runs.append(measure(kind, model, texts, args) | {"round": r})
            row = runs[-1]
            print(f"round {r} {kind:9s} {row['calls_per_s']:7,.0f} calls/s  p50 {row['p50_ms']:6.2f} ms  "
                  f"server {row['server_us']:5.0f} µs/call  clients {row['clients_us']:5.0f} µs/call", flush=True)
    summary = {k: statistics.median(r["server_us"] for r in runs if r["kind"] == k) for k in kinds}
    table = table_of(runs, kinds, summary)
    print(table)
    if args.out:
        m = versions()
        command = "python load/bench_frontend_floor.py" + (" --tokenizer TOKENIZER.json" if args.tokenizer else "") + \
            f" --rounds {args.rounds} --seconds {args.seconds} --clients {args.clients}" + \
            (f" --client-processes {args.client_processes}" if args.client_processes != 1 else "")
        head = (f"# A frontend's CPU per unary query, layer by layer, {m['date']}\n\n{m['cores']} cores, "
                f"grpcio {m['grpcio']}, Python {m['python']}; tokenizer: "
                f"{'Qwen3 (' + os.path.basename(args.tokenizer) + ')' if args.tokenizer else 'all-MiniLM-L6-v2'}; "
                f"{args.clients} closed-loop clients. Command: `{command}`.\n\n")
        write_results_to(args.out, {"meta": m, "runs": runs, "median_server_us": summary}, head, table)


def table_of(runs: list[dict], kinds: list[str], summary: dict) -> str:
    rows = ["| server | CPU µs per call (median) | each round | over the row above | calls/s (median) |",
            "| --- | ---: | --- | ---: | ---: |"]
    before = None
    for kind in kinds:
        mine = [r for r in runs if r["kind"] == kind]
        added = "" if before is None else f"{summary[kind] - before:+,.0f}"
        each = ", ".join(f"{r['server_us']:,.0f}" for r in mine)
        rows.append(f"| {kind} | {summary[kind]:,.0f} | {each} | {added} | "
                    f"{statistics.median(r['calls_per_s'] for r in mine):,.0f} |")
        before = summary[kind]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
