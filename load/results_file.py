"""Where benchmarks leave their figures: load/results/<stem>.json (everything) and <stem>.md (the table)."""
from __future__ import annotations

import json
import os
import pathlib


def write_results(out_dir: str, stem: str, result: dict, header: str, table: str) -> None:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(header + table + "\n")
    print(f"wrote {out / stem}.json and .md")


def write_results_to(out: str, result: dict, header: str, table: str) -> None:
    """write_results for a benchmark's --out: a path without suffix (a bare stem writes here)."""
    write_results(os.path.dirname(out) or ".", os.path.basename(out), result, header, table)
