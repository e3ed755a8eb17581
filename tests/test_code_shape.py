"""The product code's shape, checked: small functions. A function over MAX_LINES says why in its
docstring, in a line that starts with "Long because"."""
from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("common", "server", "shared_mem", "worker", "client", "bulk")
MAX_LINES = 60


def long_functions() -> list[str]:
    found = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                lines = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if lines > MAX_LINES and "Long because" not in doc:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_product_code_is_over_60_lines_without_a_reason():
    assert long_functions() == []


# What a product comment or docstring must not hold: it says what the code does and why, in the
# present; measurements, dates and machines belong in docs/performance.md and in git.
NARRATION = re.compile(r"\b20\d\d-[01]\d\b|\d\s?(µs|us|microseconds?)\b|\bH[12]00\b|\bmachine\s?\d|"
                       r"2-core machine|load/results|gpu-notes", re.IGNORECASE)


def comments(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in a file."""
    source = path.read_text()
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    return found


def narrating_comments() -> list[str]:
    found = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for line, text in comments(path):
                if match := NARRATION.search(text):
                    found.append(f"{path.relative_to(ROOT)}:{line} {match.group()!r}")
    return found


def test_no_product_comment_holds_a_date_a_machine_or_a_measured_time():
    assert narrating_comments() == []


def test_the_narration_check_catches_what_it_is_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Measured 2026-12-02 on the H200."""\nx = 1  # a lone query paid 6-8 µs here\n')
    assert sorted(m.group() for _, text in comments(sample) for m in [NARRATION.search(text)] if m) == \
        ["2026-12", "8 µs"]
