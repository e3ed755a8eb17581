"""load/bench_query_pieces.py runs on a byte-level BPE tokenizer (trained here, as in
tests/test_ascii_bpe.py) and refuses one tiktoken does not reproduce. Timings are not checked."""
from __future__ import annotations

import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import bench_query_pieces as bench  # noqa: E402
from pollen.common.model_spec import default_model_path  # noqa: E402
from tests.test_ascii_bpe import QWEN3, train  # noqa: E402


def test_it_measures_each_piece_of_a_byte_level_tokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    train(QWEN3).save(str(path))
    figures = bench.measure(str(path), calls=50, repeats=1)
    assert len(figures) == 5 and all(us > 0 for us in figures.values())


def test_a_tokenizer_tiktoken_cannot_reproduce_is_refused():
    with pytest.raises(SystemExit, match="tiktoken does not reproduce"):
        bench.measure(f"{default_model_path()}/tokenizer.json", calls=1, repeats=1)
