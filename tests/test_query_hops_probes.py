"""load/bench_query_hops.py puts probe lines into a copy of the package by anchoring on lines of
today's code: each anchor must still be there exactly once, and the probed files must still
compile, or the benchmark would stop (or, worse, time the wrong hop) on the GPU machine."""
import json
import pathlib
import py_compile
import subprocess
import sys

import numpy as np
import pytest

from load import bench_query_hops as hops

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_every_probe_finds_its_line_and_the_probed_package_compiles(tmp_path):
    tree = hops.probed_copy(tmp_path / "tree", str(tmp_path / "events"))
    probed = {path for _, path, *_ in hops.PROBES if path}
    for name, path, *_ in hops.PROBES:
        if path:
            assert f"hop_probe.mark({name!r})" in (tree / "pollen" / path).read_text()
    for path in probed:
        py_compile.compile(str(tree / "pollen" / path), doraise=True)


def test_hops_are_measured_between_the_probes_in_order():
    # One call from t=0 to t=1300 µs with every mark, a stray frontend wake-up before the real one,
    # and a call whose worker marks are missing (left out, not counted as zero).
    order = hops.ORDER[1:-1]  # the probes between the client's send (C0) and receive (C1)
    times = {name: 100 * (i + 1) for i, name in enumerate(order)}
    marks = sorted([(t * 1000, name) for name, t in times.items()] + [(times["W2"] * 1000 + 1, "F3")])
    second = [(10_000_000 + 50_000, "F0")]
    ns = np.array([t for t, _ in marks + second], dtype=np.int64)
    names = [n for _, n in marks + second]
    gaps = hops.hops([(0, 1_300_000), (10_000_000, 11_000_000)], ns, names)
    assert len(gaps["total"]) == 1
    assert gaps["F0"] == [100.0] and gaps["C1"] == [1300.0 - 100 * len(order)]
    assert gaps["F3"] == [times["F3"] - times["W4"]]  # the last wake-up before the answer counts


@pytest.mark.slow
def test_the_benchmark_runs_on_the_cpu_and_every_hop_is_timed(tmp_path):
    """The whole tool against a real `pollen serve` (the micro BERT): the server runs the probed
    copy (PYTHONPATH), so nearly every call carries every mark and the hops add up to the calls."""
    out = tmp_path / "hops"
    subprocess.run([sys.executable, str(REPO / "load" / "bench_query_hops.py"), "--calls", "100", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["calls"] == 100 and result["calls_with_every_mark"] >= 90
    assert all(hop["p50_us"] > 0 for hop in result["hops"].values())
    means = sum(hop["mean_us"] for hop in result["hops"].values())
    assert abs(means - result["round_trip_p50_us"]) < result["round_trip_p50_us"]  # same order: no hop lost
