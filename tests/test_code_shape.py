"""The product code's shape, checked: small functions. A function over MAX_LINES says why in its
docstring, in a line that starts with "Long because"."""
from __future__ import annotations

import ast
import pathlib

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
