"""One client, one query at a time: where a lone query's time goes, by frontend count and client API.

    python load/bench_one_client.py --tokenizer TOKENIZER.json [--shape qwen3-0.6b] [--frontends 0,1,7]
           [--calls 2000] [--device cuda] [--server-flags "--worker-spin-us 0" ...]

For each --frontends value (0: the server's default) a fresh `pollen serve` (defaults otherwise)
is started and answers --calls queries sent one after the other (after a warm-up), from three
clients in turn (and again for each --server-flags given: an A/B in one run, in the order given):

  sync    grpc's blocking stub (the calling thread waits on the call itself)
  aio     grpc.aio's stub on uvloop, as load/load_clients.py sends (the concurrency benchmark)
  pollen  pollen.client.Client.embed (several connections, see client/connections.py)
  http    POST /v1/embeddings on one HTTP/1.1 keep-alive connection, from a minimal client on a
          raw socket (so the figures are the server's): the HTTP door beside gRPC's

Each row gives the wall time's p50 and p99 and, for the stubs, the server's own share from the
answer's Timing (queue_us + inference_us: admission to the last batch's end, each given too), so
`rest` is everything outside the worker: both clients' and the frontend's gRPC, tokenization, the
rings and the wake-ups. The queries are those of load/bench_concurrency.py (12-13 Qwen3 tokens).
Writes load/results/one_client-<kind>.md (load/results_file.py).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.bench_concurrency import add_model_args, query_texts, server_flags, server_info, versions  # noqa: E402
from load.gpu_models import make_checkpoint, with_tokenizer  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402

WARM_CALLS = 200
CLIENTS = ("sync", "aio", "pollen", "http")


def figures(wall_s: list[float], timings: list[tuple[int, int]]) -> dict:
    """Wall p50/p99; with the answers' (queue_us, inference_us), the worker's share and the rest."""
    wall = np.asarray(wall_s) * 1e3
    out = {"calls": len(wall), "p50_ms": float(np.percentile(wall, 50)), "p99_ms": float(np.percentile(wall, 99))}
    if timings:
        queue, inference = (np.asarray(t) / 1e3 for t in zip(*timings))
        out["queue_p50_ms"] = float(np.percentile(queue, 50))
        out["inference_p50_ms"] = float(np.percentile(inference, 50))
        out["server_p50_ms"] = float(np.percentile(queue + inference, 50))
        out["rest_p50_ms"] = float(np.percentile(wall - queue - inference, 50))
    return out


def sync_client(server, texts: list[str], calls: int) -> dict:
    import grpc

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    wall, shares = [], []
    with grpc.insecure_channel(server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        for n in range(WARM_CALLS + calls):
            request = pb.EmbedRequest(texts=[texts[n % len(texts)]], normalize=True)
            began = time.perf_counter()
            answer = stub.Embed(request, timeout=60)
            if n >= WARM_CALLS:
                wall.append(time.perf_counter() - began)
                shares.append((answer.timing.queue_us, answer.timing.inference_us))
    return figures(wall, shares)


def aio_client(server, texts: list[str], calls: int) -> dict:
    import grpc
    import uvloop

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    async def run() -> dict:
        wall, server = [], []
        async with grpc.aio.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            for n in range(WARM_CALLS + calls):
                request = pb.EmbedRequest(texts=[texts[n % len(texts)]], normalize=True)
                began = time.perf_counter()
                answer = await stub.Embed(request, timeout=60)
                if n >= WARM_CALLS:
                    wall.append(time.perf_counter() - began)
                    server.append((answer.timing.queue_us, answer.timing.inference_us))
        return figures(wall, server)

    return uvloop.run(run())


def pollen_client(server, texts: list[str], calls: int) -> dict:
    from pollen.client import Client

    wall = []
    with Client(server.listen) as client:
        for n in range(WARM_CALLS + calls):
            began = time.perf_counter()
            client.embed(texts[n % len(texts)])
            if n >= WARM_CALLS:
                wall.append(time.perf_counter() - began)
    return figures(wall, [])


def http_client(server, texts: list[str], calls: int) -> dict:
    import json
    import socket

    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer, wall = b"", []
    try:
        for n in range(WARM_CALLS + calls):
            body = json.dumps({"input": texts[n % len(texts)], "encoding_format": "float"}).encode()
            began = time.perf_counter()
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            while b"\r\n\r\n" not in buffer:
                buffer += sock.recv(1 << 20)
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            while len(buffer) < length:
                buffer += sock.recv(1 << 20)
            if head.split(b" ", 2)[1] != b"200":
                raise RuntimeError(f"HTTP {head.split(b' ', 2)[1].decode()}: {buffer[:200]!r}")
            buffer = buffer[length:]
            if n >= WARM_CALLS:
                wall.append(time.perf_counter() - began)
    finally:
        sock.close()
    return figures(wall, [])


RUN = {"sync": sync_client, "aio": aio_client, "pollen": pollen_client, "http": http_client}


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--frontends", default="0,1", help="frontend counts to compare (0: the default)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--server-flags", action="append",
                   help="extra `pollen serve` flags, after any NAME=VALUE for its environment (`GRPC_EXPERIMENTS=`); "
                        "given several times, a server for each, in turn")
    add_out_argument(p, "one_client")
    args = p.parse_args()

    path = with_tokenizer(make_checkpoint(args.shape, args.root), args.tokenizer)
    texts = query_texts()
    # The clients' own gRPC settings (they run in this process).
    result = {"meta": versions(), "rows": [], "client_grpc_experiments": os.environ.get("GRPC_EXPERIMENTS")}
    for frontends, flags in itertools.product(map(int, args.frontends.split(",")), args.server_flags or [""]):
        env, extra = server_flags(flags)
        server = ServerProcess("--model", path, "--device", args.device, "--frontends", str(frontends),
                               "--log-level", "WARNING", *extra, env=env).start(timeout=600)
        try:
            started = server_info(server.listen)["frontends"]
            for client in args.clients.split(","):
                row = {"frontends": started, "flags": flags, "client": client} | RUN[client](server, texts,
                                                                                             args.calls)
                result["rows"].append(row)
                print(row, flush=True)
        finally:
            server.terminate()
    write_result("one_client", device_kind(args.device), "One client, one query at a time",
                 header(result) + table(result["rows"]), result, args.out)


def header(result: dict) -> str:
    m = result["meta"]
    return (f"{m.get('gpu', 'CPU')}, {m['cores']} cores, torch {m['torch']}, grpcio {m['grpcio']}, Python "
            f"{m['python']}, {m['date']}. `server` is the answer's queue_us + inference_us (the worker's share); `rest` is the wall time "
            "less that, per call. The clients' GRPC_EXPERIMENTS: "
            f"{result.get('client_grpc_experiments') or 'unset (gRPC defaults)'}.\n\n")


def table(rows: list[dict]) -> str:
    lines = ["| frontends | flags | client | calls | p50 ms | p99 ms | server p50 ms (queue / inference) | rest p50 ms |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        server = (f"{r['server_p50_ms']:.2f} ({r['queue_p50_ms']:.2f} / {r['inference_p50_ms']:.2f})"
                  if "server_p50_ms" in r else "")
        rest = f"{r['rest_p50_ms']:.2f}" if "rest_p50_ms" in r else ""
        lines.append(f"| {r['frontends']} | {r.get('flags') or 'defaults'} | {r['client']} | {r['calls']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                     f"{server} | {rest} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
