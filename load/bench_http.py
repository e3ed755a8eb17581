"""Single-query latency over the HTTP door, beside gRPC unary on the same server.

    python load/bench_http.py                 # `pollen serve` on its defaults (all-MiniLM-L6-v2, CPU)
    python load/bench_http.py --device cuda --tokenizer TOKENIZER.json   # the Qwen3-0.6B shape on the GPU

Starts its own server, prints a table and writes load/results/http-<kind>.md (load/results_file.py).
One short text at a time, sequentially, after a warm-up: HTTP/1.1 POST /v1/embeddings on one
keep-alive connection (a minimal client on a raw socket, so the figures are the server's) and
gRPC unary Embed on one channel, taking turns query by query. p50 and p99 of each over `--queries`.
The texts: STS-B sentences on the CPU; on cuda load/bench_concurrency.py's queries, and the checkpoint
load/gpu_models.py's (random weights in the real shape) beside the real Qwen3 tokenizer.json
(--tokenizer, or POLLEN_QWEN3_TOKENIZER).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import sys
import time

import grpc
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load.bench_cpu import machine, make_docs  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402


class KeepAlive:
    """POST on one persistent connection; reads exactly one response per request."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def post(self, path: str, body: bytes) -> bytes:
        self.sock.sendall(b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(self.buffer) < length:
            self.buffer += self._recv()
        answer, self.buffer = self.buffer[:length], self.buffer[length:]
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {answer[:200]!r}")
        return answer

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def percentiles(times: list[float]) -> dict:
    q = np.percentile(times, [50, 99])
    return {"requests": len(times), "p50_ms": round(float(q[0]), 3), "p99_ms": round(float(q[1]), 3),
            "mean_ms": round(float(np.mean(times)), 3)}


def latencies(port: int, target: str, texts: list[str], warmup: int) -> tuple[dict, dict]:
    """HTTP and gRPC in turn, one query each, so that both see the same machine at the same time."""
    client = KeepAlive(port)
    bodies = [json.dumps({"input": t, "encoding_format": "float"}).encode() for t in texts]
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        for text, body in zip(texts[:warmup], bodies):
            client.post("/v1/embeddings", body)
            stub.Embed(pb.EmbedRequest(texts=[text], normalize=True))
        http_ms, grpc_ms = [], []
        for text, body in zip(texts, bodies):
            t0 = time.perf_counter()
            client.post("/v1/embeddings", body)
            t1 = time.perf_counter()
            stub.Embed(pb.EmbedRequest(texts=[text], normalize=True))
            t2 = time.perf_counter()
            http_ms.append((t1 - t0) * 1e3)
            grpc_ms.append((t2 - t1) * 1e3)
    client.close()
    return percentiles(http_ms), percentiles(grpc_ms)


def measure(server_flags: list[str], texts: list[str], warmup: int) -> dict:
    import h11

    load_before = os.getloadavg()[0]
    srv = ServerProcess("--log-level", "WARNING", *server_flags).start(timeout=600)
    try:
        http, rpc = latencies(srv.http_port, srv.listen, texts, warmup)
    finally:
        srv.terminate()
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]  # 1-minute load average, before and after
    return {"date": time.strftime("%Y-%m-%d"), "device": machine(),
            "versions": {"python": platform.python_version(), "grpcio": grpc.__version__, "h11": h11.__version__},
            "server_flags": server_flags, "load_average": load, "http": http, "grpc": rpc}


def table(run: dict) -> str:
    h, g = run["http"], run["grpc"]
    return "\n".join(["| load before, after | HTTP p50 | HTTP p99 | gRPC p50 | gRPC p99 | HTTP - gRPC (p50) |",
                      "| --- | --- | --- | --- | --- | --- |",
                      f"| {run['load_average'][0]}, {run['load_average'][1]} | {h['p50_ms']} ms | {h['p99_ms']} ms | "
                      f"{g['p50_ms']} ms | {g['p99_ms']} ms | {h['p50_ms'] - g['p50_ms']:+.3f} ms |"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu: the server's defaults; cuda: the --shape checkpoint")
    parser.add_argument("--shape", default="qwen3-0.6b", help="with --device cuda (load/gpu_models.py)")
    parser.add_argument("--root", default="/tmp/pollen-ckpt")
    parser.add_argument("--tokenizer", default=os.environ.get("POLLEN_QWEN3_TOKENIZER"),
                        help="with --device cuda: the model's tokenizer.json (the real Qwen3 one)")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    add_out_argument(parser, "http")
    args = parser.parse_args()

    if args.device == "cpu":
        flags, texts = [], [d.split(".")[0] for d in make_docs(args.queries, seed=2)]
    else:
        from load.bench_concurrency import query_texts
        from load.gpu_models import make_checkpoint, with_tokenizer

        if not args.tokenizer:
            parser.error("--device cuda needs --tokenizer (or POLLEN_QWEN3_TOKENIZER)")
        flags = ["--model", with_tokenizer(make_checkpoint(args.shape, args.root), args.tokenizer),
                 "--device", args.device]
        texts = query_texts()[:args.queries]
    run = measure(flags, texts, args.warmup)
    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("POLLEN_")) or "none"
    model = f"the {args.shape} shape on {args.device}" if flags else "its defaults (all-MiniLM-L6-v2 on the CPU)"
    header = (f"{run['device']}; python {run['versions']['python']}, grpcio {run['versions']['grpcio']}, "
              f"h11 {run['versions']['h11']}, {run['date']}; `pollen serve` on {model}, POLLEN_* settings in the "
              f"environment: {settings}. {args.queries} queries after {args.warmup} of warm-up; HTTP and gRPC "
              "take turns query by query; client and server on the same machine.\n\n")
    print(table(run))
    write_result("http", device_kind(args.device), "One query at a time: HTTP keep-alive and gRPC unary",
                 header + table(run), run, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
