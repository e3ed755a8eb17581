"""The committed generated code equals what protos/generate.py makes from the .proto files."""
from __future__ import annotations

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", REPO / "protos" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    made = generate.generate(tmp_path)
    assert made, "protoc wrote nothing"
    for path in made:
        rel = path.relative_to(tmp_path)
        committed = REPO / "protos" / rel
        assert committed.exists(), f"{rel} is not committed; run python protos/generate.py"
        assert committed.read_bytes() == path.read_bytes(), f"{rel} is stale; run python protos/generate.py"
