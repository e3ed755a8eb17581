"""Where benchmarks leave their figures: load/results/<stem>.json (everything) and <stem>.md (the table)."""
from __future__ import annotations

import json
import pathlib


def write_results(out_dir: str, stem: str, result: dict, header: str, table: str) -> None:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(header + table + "\n")
    print(f"wrote {out / stem}.json and .md")
