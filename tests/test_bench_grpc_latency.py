"""load/bench_grpc_latency.py end to end on this machine, small: its stand-in server and its
clients are real processes talking real gRPC, each started with its variant's environment. No
timing is judged here, only that every cell answers every call and the table shows each cell."""
from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import bench_grpc_latency as bench  # noqa: E402
from load.bench_frontend_floor import model_dir  # noqa: E402
from pollen.server.grpc_core import IOMGR_EXPERIMENTS  # noqa: E402


def test_each_side_gets_its_variants_environment():
    assert bench.VARIANTS["default"] == ({}, {})
    server, client = bench.VARIANTS["iomgr-server"]
    assert server["GRPC_EXPERIMENTS"] == IOMGR_EXPERIMENTS and "GRPC_EXPERIMENTS" not in client
    server, client = bench.VARIANTS["iomgr-client"]
    assert client["GRPC_EXPERIMENTS"] == IOMGR_EXPERIMENTS and "GRPC_EXPERIMENTS" not in server


def test_cells_answer_every_call_and_fill_the_table():
    model, runs = model_dir(""), []
    cells = [("grpc", "sync", "tcp", "default"), ("grpc", "aio", "unix", "iomgr")]
    for cell in cells:
        runs.append(bench.one_cell(*cell, model, 30) | {"round": 0})
    assert [r["calls"] for r in runs] == [30, 30]
    assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in runs)
    table = bench.table_of(runs, cells)
    assert "| grpc | sync | tcp | default |" in table and "| grpc | aio | unix | iomgr |" in table
