"""load/bench_placement.py on this machine, small: a real `pollen serve` (a tiny random Qwen3 on
the CPU) answering real gRPC while the benchmark moves its frontends' threads. No timing is judged
here, only that each placement's block is answered and that `pinned` really holds the serving
frontend's busy threads on its one core."""
from __future__ import annotations

import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import bench_placement as bench  # noqa: E402
from load.gpu_models import make_checkpoint  # noqa: E402


def test_each_placement_answers_and_pinned_holds_its_core(tmp_path):
    rows = bench.one_start(make_checkpoint("qwen3-tiny", str(tmp_path)), "cpu", start=0, rounds=1, calls=10)
    assert [r["placement"] for r in rows] == list(bench.PLACEMENTS)
    assert all(0 < r["p50_ms"] <= r["p99_ms"] and r["server_p50_ms"] > 0 for r in rows)
    shared, pinned = rows
    assert pinned["serving_affinity"] == [pinned["pinned_core"]]
    assert set(pinned["serving_cores"]) <= {pinned["pinned_core"]}  # where its busy threads last ran
    assert shared["serving_affinity"] == sorted(os.sched_getaffinity(0))  # CPU workers: the frontend inherits all
    table = bench.table(rows)
    assert "| 0 | shared | 1 |" in table and "| 0 | pinned | 1 |" in table
