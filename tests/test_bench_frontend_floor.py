"""load/bench_frontend_floor.py runs: each stand-in server answers real gRPC calls from the load
clients and is measured by its process's CPU time (no timings asserted, only that it ran)."""
from __future__ import annotations

import argparse
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import bench_frontend_floor as floor  # noqa: E402
from load.bench_concurrency import query_texts  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("kind", floor.KINDS)
def test_each_server_of_the_ladder_answers_and_is_measured(kind):
    args = argparse.Namespace(clients=4, client_processes=1, seconds=1.0)
    row = floor.measure(kind, floor.model_dir(""), query_texts(200), args)
    assert row["kind"] == kind and row["errors"] == 0
    assert row["calls_per_s"] > 0 and row["server_us"] > 0 and row["clients_us"] > 0


def test_the_table_gives_each_layer_what_it_adds():
    runs = [{"kind": k, "server_us": us, "calls_per_s": 1000.0} for k, us in
            [("grpc", 200.0), ("grpc", 220.0), ("tokenize", 300.0), ("tokenize", 320.0)]]
    table = floor.table_of(runs, ["grpc", "tokenize"], {"grpc": 210.0, "tokenize": 310.0})
    assert "| grpc | 210 | 200, 220 |  | 1,000 |" in table
    assert "| tokenize | 310 | 300, 320 | +100 | 1,000 |" in table
