"""load/bench_one_client.py's figures and table from made-up timings (no server): the worker's
share and the rest are split per call before their medians are taken."""
from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import bench_one_client as bench  # noqa: E402


def test_figures_split_the_workers_share_from_the_rest():
    wall = [0.002, 0.003, 0.004]               # seconds
    timings = [(100, 900), (200, 1000), (300, 1100)]  # (queue_us, inference_us)
    f = bench.figures(wall, timings)
    assert f["calls"] == 3 and f["p50_ms"] == 3.0
    assert (f["queue_p50_ms"], f["inference_p50_ms"], f["server_p50_ms"]) == (0.2, 1.0, 1.2)
    assert abs(f["rest_p50_ms"] - 1.8) < 1e-9  # 3.0 - 1.2 for the middle call
    assert "rest_p50_ms" not in bench.figures(wall, [])  # a client that sees no Timing


def test_the_table_has_a_row_per_server_and_client():
    rows = [{"frontends": 11, "flags": "", "client": "sync"} | bench.figures([0.002], [(90, 880)]),
            {"frontends": 11, "flags": "--worker-spin-us 0", "client": "pollen"} | bench.figures([0.0025], [])]
    text = bench.table(rows)
    assert "| 11 | defaults | sync | 1 | 2.00 | 2.00 | 0.97 (0.09 / 0.88) | 1.03 |" in text
    assert "| 11 | --worker-spin-us 0 | pollen | 1 | 2.50 | 2.50 |  |  |" in text
