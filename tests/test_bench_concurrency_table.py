"""load/bench_concurrency.py's table from a result (no server: the figures are made up here, and
only how they are laid out is checked)."""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import bench_concurrency as bench  # noqa: E402


def level(qps: float, frontends: float, clients: float) -> dict:
    return {"queries_per_s": qps, "p50_ms": 5.0, "p99_ms": 9.0,
            "cores_busy": {"frontends": frontends, "workers": 1.0, "clients": clients}}


def test_the_table_gives_each_levels_cpu_per_query():
    result = {"levels": {"unary-128": level(10_000.0, 8.0, 3.0), "unary-512": level(0.0, 0.0, 0.0)}}
    text = bench.table(result, argparse.Namespace(kinds="unary", clients="128,512"))
    assert "| 128 | 10,000 | 5.00 | 9.00 |" in text
    assert "unary-128 8.0 / 1.0 / 3.0" in text
    assert "CPU a query, µs (frontends / worker / the whole server / clients), at each level: unary-128 800 / 100 / 900 / 300." in text
    assert "unary-512 0 /" not in text  # a level that answered nothing has no figure per query


def test_a_repeated_level_keeps_its_own_row():
    assert bench.level_keys("unary", "512,128,512") == [("unary-512", 512), ("unary-128", 128), ("unary-512-2", 512)]
    result = {"levels": {"unary-512": level(23_000.0, 9.0, 4.0), "unary-128": level(17_000.0, 9.0, 4.0),
                         "unary-512-2": level(22_000.0, 9.0, 4.0)}}
    text = bench.table(result, argparse.Namespace(kinds="unary", clients="512,128,512"))
    assert "| 512 | 23,000 |" in text and "| 512 | 22,000 |" in text


def test_the_worker_figures_of_a_level_come_from_two_scrapes():
    before = {"batches": 10.0, "eager": 1.0, "padded": 0.0, "graphs": 40.0, "tokens": 1000.0, "queue_s": 0.5,
              "requests": 100.0, "seconds_wait": 1.0, "seconds_launch": 1.0}
    after = {"batches": 110.0, "eager": 4.0, "padded": 20.0, "graphs": 42.0, "tokens": 51000.0, "queue_s": 2.5,
             "requests": 1100.0, "seconds_wait": 1.5, "seconds_launch": 5.5}
    w = bench.worker_delta(before, after)
    assert w == {"batches": 100.0, "eager": 3.0, "padded": 20.0, "tokens_per_batch": 500.0, "queue_ms": 2.0,
                 "wait_share": 0.1, "graphs": 42.0}
    result = {"levels": {"unary-512": level(20_000.0, 9.0, 4.0) | {"worker": w}}}
    text = bench.table(result, argparse.Namespace(kinds="unary", clients="512"))
    assert "unary-512 100, 500, 3 / 20, 2.00, 0.10, 42." in text


def test_the_machines_idle_and_stolen_cores_are_reported_per_level():
    busy = {"frontends": 6.7, "workers": 0.9, "clients": 2.9, "machine": {"busy": 9.6, "idle": 1.2, "steal": 5.2}}
    result = {"levels": {"unary-512": {"queries_per_s": 12_000.0, "p50_ms": 27.0, "p99_ms": 45.0, "cores_busy": busy}}}
    text = bench.table(result, argparse.Namespace(kinds="unary", clients="512"))
    assert "(busy / idle / stolen by the hypervisor): unary-512 9.6 / 1.2 / 5.2." in text


def test_the_machine_figures_are_cores_over_the_window():
    from load.load_clients import _machine_cpu, cores_busy

    first = _machine_cpu()
    assert set(first) == {"busy", "idle", "steal"} and all(v >= 0 for v in first.values())
    busy = cores_busy({}, time.time(), 0.3)
    total = sum(busy["machine"].values())
    # busy + idle + steal over the window add up to the machine's cores (/proc/stat counts every CPU)
    assert 0.5 * os.cpu_count() <= total <= 1.5 * os.cpu_count()


def test_server_flags_take_leading_environment_words():
    from load.bench_concurrency import server_flags

    assert server_flags("") == ({}, [])
    assert server_flags("GRPC_EXPERIMENTS= --frontends 2") == ({"GRPC_EXPERIMENTS": ""}, ["--frontends", "2"])
    assert server_flags("A=1 B='x y' --flag a=b") == ({"A": "1", "B": "x y"}, ["--flag", "a=b"])
    assert server_flags("--frontend-spin-us 0") == ({}, ["--frontend-spin-us", "0"])
