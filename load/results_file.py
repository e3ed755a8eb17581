"""Where a benchmark leaves its figures: load/results/<benchmark>-<kind>.md, one file per benchmark
and device kind, replaced by the next run.

<benchmark> is the script's name without `bench_` and `.py` (engine, e2e, concurrency, ...); <kind> is
`cpu` for a run without a GPU and `gpu-<model>` from the GPU's name (`NVIDIA H200` -> `gpu-h200`).
The file holds the benchmark's title and table, the exact command line, the commit of the pollen
that was measured, and every raw figure in a fenced json block (`read_figures` reads it back).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

LOAD = pathlib.Path(__file__).resolve().parent
RESULTS = LOAD / "results"
NAME = re.compile(r"^(?P<benchmark>[a-z0-9_]+)-(?P<kind>cpu|gpu-[a-z0-9-]+)\.md$")


def device_kind(device: str = "cuda") -> str:
    """`cpu` when the run's model is on the CPU (or no GPU is visible), else `gpu-<model slug>`."""
    if device == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return gpu_kind(torch.cuda.get_device_name(0))


def gpu_kind(name: str) -> str:
    """`NVIDIA H200` -> `gpu-h200`, `NVIDIA H100 80GB HBM3` -> `gpu-h100-80gb-hbm3`."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-")
    return f"gpu-{slug or 'unknown'}"


def result_path(benchmark: str, kind: str) -> pathlib.Path:
    return RESULTS / f"{benchmark}-{kind}.md"


def add_out_argument(parser, benchmark: str) -> None:
    """--out: the result file, by default the convention's path for this benchmark and device kind."""
    parser.add_argument("--out", default=None,
                        help=f"the result file (default: load/results/{benchmark}-<kind>.md, <kind> cpu or gpu-<model>)")


def command_line() -> str:
    """This process's command as a user would type it from the repository root."""
    script = pathlib.Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(LOAD.parent)
    except ValueError:
        pass
    return " ".join(["python", shlex.quote(str(script)), *map(shlex.quote, sys.argv[1:])])


def _describe(folder: pathlib.Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(folder), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def measured_commit() -> str:
    """The commit of the pollen that runs (the checkout of the imported package), and of load/ when
    that is another checkout (an A/B run measures one commit with another's benchmarks)."""
    import pollen

    measured = _describe(pathlib.Path(pollen.__path__[0]).resolve())
    here = _describe(LOAD)
    if measured is None:
        return f"unknown (load/ at {here})" if here else "unknown"
    return measured if here in (None, measured) else f"{measured} (load/ at {here})"


def write_result(benchmark: str, kind: str, title: str, text: str, figures: dict, out: str | None = None,
                 command: str | None = None, commit: str | None = None) -> pathlib.Path:
    """Write (replace) the result file: title, command, commit, the benchmark's text, the raw figures.
    `command` and `commit` stand in for this process's own (load/ab_report.py records its caller's)."""
    path = pathlib.Path(out) if out else result_path(benchmark, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = (f"# {title}\n\nCommand: `{command or command_line()}`\n\nCommit: {commit or measured_commit()}\n\n"
            f"{text.strip()}\n\n"
            f"```json\n{json.dumps(figures, indent=1, default=float)}\n```\n")
    path.write_text(body)
    shown = path.resolve()
    print(f"wrote {shown.relative_to(LOAD.parent) if shown.is_relative_to(LOAD.parent) else shown}", flush=True)
    return path


def read_figures(path: str | os.PathLike) -> dict:
    """The raw figures of a result file (its fenced json block)."""
    text = pathlib.Path(path).read_text()
    match = re.search(r"```json\n(.*?)\n```", text, re.S)
    if match is None:
        raise ValueError(f"{path}: no json block")
    return json.loads(match.group(1))
