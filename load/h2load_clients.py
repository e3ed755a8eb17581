"""Closed-loop gRPC unary load from h2load, nghttp2's native HTTP/2 load generator.

Python's gRPC client costs about as much CPU per call as a pollen frontend (250-300 µs, see
load/load_clients.py), so on a 16-core host that also runs the server, Python clients take a third
of the cores and the machine saturates before the server does. A search service calling its
sidecar from Go, Java or C++ pays a fraction of that. h2load (Debian/Ubuntu package
nghttp2-client) stands in for such a client: every call is a real gRPC unary call over HTTP/2
(POST /pollen.v1.Embedder/Embed, `application/grpc`, a length-prefixed EmbedRequest with one
text), answered by the server's real gRPC stack, and each connection keeps its share of the
clients' calls in flight (`-m`), so the load is closed-loop like load_clients' clients.

What h2load cannot see is gRPC's own status: a refused call is still HTTP 200 with a
grpc-status trailer. So the server's own count of gRPC calls by outcome (/metrics) is read
before and after, and every call it did not answer ok counts as an error here, but CANCELLED:
h2load resets the streams still in flight when its time is up (up to `clients` of them, after
the timed window), and the server counts those as cancelled. They are reported apart.

Each of the `processes` h2load processes sends one text (h2load sends one body), so a level
carries that many different queries; their connections spread over the frontends by the
kernel (SO_REUSEPORT) as any client's do.
"""
from __future__ import annotations

import math
import os
import shutil
import struct
import subprocess
import tempfile
import time

import numpy as np

from load import load_clients, server_metrics

CONNECTIONS_PER_PROCESS = 16  # as load_clients' processes open
STARTUP_S = 1.0  # from launch to the warm-up's start: the processes start and connect


def h2load_path() -> str | None:
    """POLLEN_H2LOAD, else h2load on PATH, else None."""
    return os.environ.get("POLLEN_H2LOAD") or shutil.which("h2load")


def grpc_body(text: str, priority: str = "interactive") -> bytes:
    """One gRPC message as it travels: a 0 byte (not compressed), the length (4 bytes, big
    endian), then the EmbedRequest."""
    from pollen.v1 import embedder_pb2 as pb

    prio = pb.PRIORITY_BULK if priority == "bulk" else pb.PRIORITY_INTERACTIVE
    message = pb.EmbedRequest(texts=[text], normalize=True, priority=prio).SerializeToString()
    return b"\0" + struct.pack(">I", len(message)) + message


def split_streams(clients: int, connections: int = CONNECTIONS_PER_PROCESS) -> tuple[int, int]:
    """(connections, streams on each) that carry exactly `clients` calls at once (h2load gives
    every connection of a process the same streams): the divisor of `clients` nearest to
    `connections` on a log scale, so that 86 clients get 43 connections of 2 streams rather
    than 2 of 43. The kernel spreads connections, not calls, over the frontends: few connections
    would load a few frontends only."""
    divisors = [d for d in range(1, clients + 1) if clients % d == 0]
    c = min(divisors, key=lambda d: (abs(math.log(d / connections)), -d))
    return c, clients // c


def embed_outcomes(http_target: str) -> dict[str, float]:
    """The server's gRPC call counts by outcome (pollen_requests_total, door grpc), once every
    frontend has written out the counts of the calls answered so far."""
    out: dict[str, float] = {}
    for s in server_metrics.settled_samples(http_target):
        if s.name == "pollen_requests_total" and s.labels.get("door") == "grpc":
            out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


def read_log(path: str, t0: float, end: float) -> tuple[np.ndarray, int]:
    """Latencies (s) of the calls that began at or after t0 and ended by `end`, and the streams
    h2load itself saw fail (status -1 or not 200) anywhere in the run."""
    rows = np.loadtxt(path, dtype=np.int64, ndmin=2) if os.path.getsize(path) else np.empty((0, 3), np.int64)
    failed = int(np.count_nonzero(rows[:, 1] != 200))
    began, took = rows[:, 0] / 1e6, rows[:, 2] / 1e6
    kept = (rows[:, 1] == 200) & (began >= t0) & (began + took <= end)
    return took[kept], failed


def run(target: str, http_target: str, clients: int, processes: int, texts: list[str], warm_s: float,
        seconds: float, priority: str = "interactive", watch: dict[str, list[int]] | None = None) -> dict:
    """`clients` calls in flight at all times from `processes` h2load processes; the same figures
    as load_clients.run (the clients' cores are the h2load processes')."""
    binary = h2load_path()
    if binary is None:
        raise RuntimeError("h2load not found (install nghttp2-client, or set POLLEN_H2LOAD)")
    processes = max(1, min(processes, clients))
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    before = embed_outcomes(http_target)
    t0 = time.time() + STARTUP_S + warm_s
    end = t0 + seconds
    # The run lasts past the window on both sides; the log's timestamps pick the window.
    lasts_ms = round((STARTUP_S + warm_s + seconds + 0.5) * 1000)
    folder = tempfile.mkdtemp(prefix="pollen-h2load-")
    procs: list[subprocess.Popen] = []
    try:
        for i, share in enumerate(shares):
            body = os.path.join(folder, f"body{i}.bin")
            with open(body, "wb") as f:
                f.write(grpc_body(texts[i % len(texts)], priority))
            connections, streams = split_streams(share)
            procs.append(subprocess.Popen(
                [binary, "-c", str(connections), "-m", str(streams), "-t", "1", "-D", f"{lasts_ms}ms", "-d", body,
                 "-H", "content-type: application/grpc", "-H", "te: trailers",
                 "--log-file", os.path.join(folder, f"log{i}.tsv"), f"http://{target}/pollen.v1.Embedder/Embed"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        busy = load_clients.cores_busy({**(watch or {}), "clients": [p.pid for p in procs]}, t0, seconds)
        outputs = [p.communicate()[0].decode(errors="replace") for p in procs]
        parts, failed = [], 0
        for i, (proc, text) in enumerate(zip(procs, outputs)):
            if proc.returncode != 0:
                raise RuntimeError(f"h2load exited with {proc.returncode}: {text[-2000:]}")
            latencies, bad = read_log(os.path.join(folder, f"log{i}.tsv"), t0, end)
            parts.append(latencies)
            failed += bad
    finally:  # a launch or a run that failed leaves no h2load running and no files behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
    after = embed_outcomes(http_target)
    refused = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in after if k not in ("ok", "CANCELLED"))
    latencies = np.concatenate(parts)
    ms = latencies * 1e3
    return {"clients": clients, "processes": processes, "completed": int(len(ms)), "errors": int(refused) + failed,
            "answered_ok": int(after.get("ok", 0.0) - before.get("ok", 0.0)),
            "cancelled_at_end": int(after.get("CANCELLED", 0.0) - before.get("CANCELLED", 0.0)),
            "completed_by_process": [int(len(p)) for p in parts], "cores_busy": busy,
            "queries_per_s": len(ms) / seconds,
            "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
            "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None}
