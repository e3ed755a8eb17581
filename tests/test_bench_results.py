"""load/results/ keeps one file per benchmark and device kind, named as load/results_file.py writes
them; and nothing in the repository describes one particular remote-run setup (wheels carried in a
folder, an install into a side directory, budgets of accelerator time): load/run_gpu.sh assumes
pollen installed on a GPU host and nothing more."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load.results_file import NAME, RESULTS, read_figures  # noqa: E402

# The benchmarks (load/bench_<name>.py), the studies a benchmark runs under a flag of its own
# (bench_rerank --tokenize), the locust file's hand-written result and load/ab_commits.sh's table.
STUDIES = {"tokenize": "rerank"}
BENCHMARKS = ({p.stem.removeprefix("bench_") for p in (REPO / "load").glob("bench_*.py")} | {"locust", "ab"}
              | {study for study, bench in STUDIES.items() if (REPO / "load" / f"bench_{bench}.py").exists()})
HAND_WRITTEN = {"locust"}  # no result writer: no json block


def test_results_are_one_file_per_benchmark_and_kind():
    names = sorted(p.name for p in RESULTS.iterdir())
    assert names, "load/results/ is empty"
    for name in names:
        match = NAME.match(name)
        assert match, f"load/results/{name} is not <benchmark>-<kind>.md (kind cpu or gpu-<model>)"
        assert match["benchmark"] in BENCHMARKS, f"load/results/{name}: no benchmark {match['benchmark']!r}"
    pairs = [(NAME.match(n)["benchmark"], NAME.match(n)["kind"]) for n in names]
    assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.md")), ids=lambda p: p.name)
def test_each_result_names_its_command_and_commit_and_keeps_its_figures(path):
    text = path.read_text()
    assert re.search(r"^Command: `[^`]+`", text, re.M), f"{path.name}: no Command line"
    assert re.search(r"^Commit: \S+", text, re.M), f"{path.name}: no Commit line"
    if NAME.match(path.name)["benchmark"] not in HAND_WRITTEN:
        assert read_figures(path)


# Each written so that it does not match itself: carried wheels, a side install, accelerator-time budgets.
SETUP = re.compile(r"\.whl[/]|--target[ ]/tmp/site|device[- ]time|device[- ]budget|run[- ]time[- ]budget|budget_left[_]s"
                   r"|carry=\[", re.I)


def test_no_file_describes_a_remote_run_setup():
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    found = []
    for name in filter(None, listed):
        path = REPO / name
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if SETUP.search(line):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
