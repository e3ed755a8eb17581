"""load/h2load_clients.py: h2load (nghttp2's native HTTP/2 load generator) as a gRPC unary client.

The real-server tests need the h2load binary (Debian/Ubuntu package nghttp2-client; .ci/run
installs it where apt can); without it they skip, and say so."""
from __future__ import annotations

import pathlib
import struct
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import h2load_clients  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402

needs_h2load = pytest.mark.skipif(h2load_clients.h2load_path() is None,
                                  reason="h2load not installed (apt-get install nghttp2-client)")


@pytest.mark.parametrize("clients", [1, 7, 16, 86, 97, 128, 512])
def test_split_streams_carries_exactly_the_clients_on_about_16_connections(clients):
    connections, streams = h2load_clients.split_streams(clients)
    assert connections * streams == clients
    if clients >= 16 and clients % 16 == 0:
        assert connections == 16
    assert connections >= min(clients, 16) or streams <= 2  # never a few connections of many streams


def test_grpc_body_is_one_length_prefixed_embed_request():
    body = h2load_clients.grpc_body("how do I reset my password", "bulk")
    assert body[0] == 0  # not compressed
    (length,) = struct.unpack(">I", body[1:5])
    assert length == len(body) - 5
    request = pb.EmbedRequest.FromString(body[5:])
    assert list(request.texts) == ["how do I reset my password"]
    assert request.normalize and request.priority == pb.PRIORITY_BULK


def test_read_log_keeps_the_calls_inside_the_window_and_counts_failed_streams(tmp_path):
    t0 = 1_800_000_000.0
    rows = [(t0 - 0.5, 200, 1000),       # began before the window
            (t0 + 0.1, 200, 2000),       # kept: 2 ms
            (t0 + 0.2, 200, 3000),       # kept: 3 ms
            (t0 + 0.999, 200, 5000),     # ended after the window
            (t0 + 0.3, -1, 100),         # a failed stream
            (t0 + 0.4, 503, 100)]        # a refused one
    log = tmp_path / "log.tsv"
    log.write_text("".join(f"{int(start * 1e6)}\t{status}\t{us}\n" for start, status, us in rows))
    latencies, failed = h2load_clients.read_log(str(log), t0, t0 + 1.0)
    assert sorted(np.round(latencies * 1e3, 3)) == [2.0, 3.0]
    assert failed == 2


@needs_h2load
def test_an_h2load_level_is_answered_by_a_real_server_and_counted():
    server = ServerProcess("--log-level", "WARNING").start()
    try:
        texts = ["how do I reset my password", "cheap flights to lisbon in march"]
        r = h2load_clients.run(server.listen, server.http_listen, clients=8, processes=2, texts=texts,
                               warm_s=0.5, seconds=2.0, watch={"frontends": server.child_pids()})
    finally:
        server.terminate()
    assert r["errors"] == 0
    assert r["completed"] > 0 and r["completed_by_process"][0] > 0 and r["completed_by_process"][1] > 0
    # The server answered ok every call timed here, and more (the warm-up's, and those after the window).
    assert r["answered_ok"] >= r["completed"]
    assert r["cancelled_at_end"] <= 8  # at most the calls in flight when h2load stopped
    assert 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["queries_per_s"] == pytest.approx(r["completed"] / 2.0)
    assert r["cores_busy"]["clients"] > 0


@needs_h2load
def test_calls_the_server_refuses_are_errors_though_h2load_sees_http_200(tmp_path):
    key = tmp_path / "keys"
    key.write_text("the-only-key\n")
    server = ServerProcess("--log-level", "WARNING", "--api-key-file", str(key)).start()
    try:  # h2load presents no key: every call is UNAUTHENTICATED, in a grpc-status trailer
        r = h2load_clients.run(server.listen, server.http_listen, clients=2, processes=1, texts=["a query"],
                               warm_s=0.2, seconds=1.0)
    finally:
        server.terminate()
    assert r["answered_ok"] == 0
    assert r["errors"] > 0


def test_the_wrapper_points_at_h2load_through_pollen_h2load(monkeypatch, tmp_path):
    fake = tmp_path / "h2load-somewhere"
    monkeypatch.setenv("POLLEN_H2LOAD", str(fake))
    assert h2load_clients.h2load_path() == str(fake)
    monkeypatch.delenv("POLLEN_H2LOAD")
    monkeypatch.setenv("PATH", "")
    assert h2load_clients.h2load_path() is None
