"""The side-by-side table of load/ab_commits.sh: the A/B figures of each commit, round by round, read
back from the result files the benchmarks wrote (FOLDER/<figure>-<old|new>-<round>.md); the
`unary` file gives several rows (the query path's guard: q/s at 1, 32, 128 and 512 clients, on one
connection, its p99, and the whole server's CPU a query).

    python load/ab_report.py FOLDER OLD NEW [--out PATH]     # writes load/results/ab-<kind>.md

Each figure's median over the rounds is compared: a throughput is kept when new / old >= 0.97, a
latency when new / old <= 1.03 (the refactor's bar: within 3%).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.results_file import add_out_argument, device_kind, read_figures, write_result  # noqa: E402

TOLERANCE = 0.03


def server_cpu_us(level: dict) -> float:
    """The whole server's CPU a query (frontends and workers, every thread, from /proc), in µs."""
    busy = level["cores_busy"]
    return (busy["frontends"] + busy["workers"]) / level["queries_per_s"] * 1e6


# row -> (the figure whose result file holds it, what it is, unit, higher is better, its value there)
FIGURES = {
    "engine": ("engine", "engine docs (bench_engine --docs-only)", "tokens/s", True,
               lambda f: f["shapes"][0]["ours_graphs"]["docs"]["tokens_per_s"]),
    "e2e": ("e2e", "docs through EmbedStream (bench_e2e --docs-only)", "tokens/s", True,
            lambda f: f["docs"]["tokens_per_s"]),
    "unary": ("unary", "unary queries at 128 clients (bench_concurrency)", "queries/s", True,
              lambda f: f["levels"]["unary-128"]["queries_per_s"]),
    "unary-p99": ("unary", "unary p99 at 128 clients", "ms", False, lambda f: f["levels"]["unary-128"]["p99_ms"]),
    "unary-cpu": ("unary", "the server's CPU a query at 128 clients", "µs", False,
                  lambda f: server_cpu_us(f["levels"]["unary-128"])),
    "unary-1": ("unary", "unary queries, one client", "queries/s", True,
                lambda f: f["levels"]["unary-1"]["queries_per_s"]),
    "unary-32": ("unary", "unary queries at 32 clients", "queries/s", True,
                 lambda f: f["levels"]["unary-32"]["queries_per_s"]),
    "unary-512": ("unary", "unary queries at 512 clients", "queries/s", True,
                  lambda f: f["levels"]["unary-512"]["queries_per_s"]),
    "one-connection": ("unary", "128 clients on one connection", "queries/s", True,
                       lambda f: f["levels"]["unary-one-connection-128"]["queries_per_s"]),
    "one": ("one", "one client p50, blocking stub (bench_one_client)", "ms", False,
            lambda f: f["rows"][0]["p50_ms"]),
}


def collect(folder: pathlib.Path) -> dict[str, dict[str, list[float]]]:
    """figure -> side -> its value in each round, in round order (a round that failed is left out)."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, (figure, _, _, _, value) in FIGURES.items():
        for side in ("old", "new"):
            paths = sorted(folder.glob(f"{figure}-{side}-*.md"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
            values = []
            for path in paths:
                try:
                    values.append(float(value(read_figures(path))))
                except (ValueError, KeyError, IndexError, ZeroDivisionError) as exc:
                    print(f"{path}: no {name} figure ({exc!r})", file=sys.stderr)
            if values:
                out.setdefault(name, {})[side] = values
    return out


def verdict(name: str, old: float, new: float) -> tuple[float, bool]:
    ratio = new / old
    higher_better = FIGURES[name][3]
    return ratio, ratio >= 1 - TOLERANCE if higher_better else ratio <= 1 + TOLERANCE


def table(values: dict[str, dict[str, list[float]]], old: str, new: str) -> str:
    lines = [f"old = {old}, new = {new}; each commit measured in turn, old first, round after round, on one host.",
             "", "| figure | unit | old, each round | new, each round | old median | new median | new / old | within 3% |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for name, (_, what, unit, _, _) in FIGURES.items():
        sides = values.get(name, {})
        if not sides:
            continue  # a figure this run did not ask for
        if "old" not in sides or "new" not in sides:
            lines.append(f"| {what} | {unit} | {fmt(sides.get('old', []))} | {fmt(sides.get('new', []))} | | | | not measured |")
            continue
        o, n = statistics.median(sides["old"]), statistics.median(sides["new"])
        ratio, ok = verdict(name, o, n)
        lines.append(f"| {what} | {unit} | {fmt(sides['old'])} | {fmt(sides['new'])} | {one(o)} | {one(n)} | "
                     f"{ratio:.3f} | {'yes' if ok else 'NO'} |")
    return "\n".join(lines) + "\n"


def one(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3f}"


def fmt(values: list[float]) -> str:
    return ", ".join(map(one, values)) or "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=pathlib.Path)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--command", default=None, help="the command to record (default: this one)")
    add_out_argument(p, "ab")
    args = p.parse_args()
    values = collect(args.folder)
    text = table(values, args.old, args.new)
    print(text)
    write_result("ab", device_kind(), "A/B: two commits measured alternately", text,
                 {"old": args.old, "new": args.new, "figures": values}, args.out, command=args.command,
                 commit=f"old {args.old}, new {args.new}")
    complete = all(len(sides) == 2 for sides in values.values()) and bool(values)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
