"""The CPU engine's batches of many texts, cut at sequence bounds into one piece per thread that run
at once (worker/cpu_engine.py, CpuEngine; worker/packed.py, split): the cut keeps every row whole
and in order, and the rows equal HF transformers' on the same texts, contextual chunks included."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from pollen.worker.eager_engine import EagerEngine
from pollen.worker.models.loader import load_model
from pollen.worker.packed import RowSpans, pack, split
from pollen.worker.thread_choice import LEARN_TOKENS
from tests.test_model_bert import make_tiny
from tests.test_model_qwen3 import hf_rows, make_tiny_qwen3, random_seqs


@pytest.fixture(autouse=True)
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_pieces_cut_at_sequence_bounds_and_keep_every_row_in_order():
    seqs = [np.arange(n, dtype=np.int32) + 10 * i for i, n in enumerate([30, 5, 60, 12, 40, 90, 7])]
    spans = [[(0, 10), (10, 30)], [(0, 5)], [(2, 20), (20, 60)], [(0, 12)], [(5, 40)], [(0, 90)], [(0, 7)]]
    batch = pack(seqs, RowSpans.of(spans))
    for parts in (2, 3, 7, 20):
        pieces = split(batch, parts)
        assert 2 <= len(pieces) <= min(parts, len(seqs))
        assert sum(p.tokens for p in pieces) == batch.tokens and sum(p.rows for p in pieces) == batch.rows
        at_seq, at_token, firsts = 0, 0, []
        for piece in pieces:
            n = len(piece.cu_seqlens) - 1
            want = pack(seqs[at_seq:at_seq + n], RowSpans.of(spans[at_seq:at_seq + n]))  # the same texts packed alone
            for field in ("ids", "positions", "cu_seqlens", "pool_index", "pool_first", "pool_last", "pool_count"):
                np.testing.assert_array_equal(getattr(piece, field), getattr(want, field), err_msg=field)
            assert piece.max_seqlen == want.max_seqlen
            firsts += (piece.pool_first + at_token).tolist()
            at_seq, at_token = at_seq + n, at_token + piece.tokens
        assert firsts == batch.pool_first.tolist()  # the pieces' rows, in turn, are the batch's
    assert split(batch, 1) == [batch] and split(pack(seqs[:1]), 4) == [pack(seqs[:1])]


def counted_pieces(engine: EagerEngine) -> list[int]:
    """How many pieces each cut batch ran its helpers on, appended as batches run."""
    seen, real = [], engine._pieces_rows

    def pieces_rows(pieces):
        seen.append(len(pieces))
        return real(pieces)

    engine._pieces_rows = pieces_rows
    return seen


@pytest.mark.parametrize("kind", ["bert", "qwen3"])
def test_a_batch_cut_in_pieces_equals_transformers(tmp_path, kind):
    seqs = random_seqs([9, 40, 64, 3, 33, 60, 17, 51, 2, 45], seed=8)
    assert sum(len(s) for s in seqs) >= LEARN_TOKENS
    if kind == "bert":
        hf = make_tiny(tmp_path / "m")
        with torch.no_grad():
            ref = torch.stack([hf(input_ids=s[None]).last_hidden_state[0].mean(0) for s in seqs])
    else:
        ref = hf_rows(make_tiny_qwen3(tmp_path / "m"), seqs, "causal")
    engine = EagerEngine(load_model(str(tmp_path / "m")), threads=2)
    pieces = counted_pieces(engine)
    rows = torch.from_numpy(engine.submit(pack([s.numpy().astype(np.int32) for s in seqs])).result())
    assert pieces == [2]
    cos = torch.nn.functional.cosine_similarity(rows, ref.float(), dim=1)
    assert cos.min() >= 0.99999 and (rows - ref).abs().max() < 1e-4
    engine.close()


def test_contextual_chunks_cut_in_pieces_equal_transformers_spans(tmp_path):
    """Rows pooled over spans of one sequence, and tokens in no row, through a cut batch: each
    row is the mean of HF's hidden states over its span."""
    hf = make_tiny(tmp_path / "m")
    seqs = random_seqs([60, 50, 64, 40, 55], seed=9)
    spans = [[(0, 20), (20, 60)], [(5, 50)], [(0, 30), (30, 40), (40, 64)], [(0, 40)], [(1, 54)]]
    with torch.no_grad():
        hidden = [hf(input_ids=s[None]).last_hidden_state[0] for s in seqs]
    ref = torch.stack([h[a:b].mean(0) for h, seq_spans in zip(hidden, spans) for a, b in seq_spans])
    engine = EagerEngine(load_model(str(tmp_path / "m")), threads=3)
    pieces = counted_pieces(engine)
    rows = torch.from_numpy(engine.submit(pack([s.numpy().astype(np.int32) for s in seqs], RowSpans.of(spans))).result())
    assert pieces == [3]
    assert torch.nn.functional.cosine_similarity(rows, ref, dim=1).min() >= 0.99999
    assert (rows - ref).abs().max() < 1e-4
    engine.close()


def test_queries_and_one_text_are_never_cut(tmp_path):
    make_tiny(tmp_path / "m")
    engine = EagerEngine(load_model(str(tmp_path / "m")), threads=2)
    pieces = counted_pieces(engine)
    engine.submit(pack([np.arange(1, 12, dtype=np.int32)])).result()  # a query
    engine.submit(pack([np.arange(1, 40, dtype=np.int32)] * 3)).result()  # under LEARN_TOKENS tokens
    assert pieces == []
    engine.close()
    one = EagerEngine(load_model(str(tmp_path / "m")), threads=1)
    assert one.helpers is None
    pieces = counted_pieces(one)
    one.submit(pack([np.arange(1, 64, dtype=np.int32)] * 8)).result()
    assert pieces == []


def test_a_batch_is_padded_to_a_multiple_of_32_tokens_and_the_padding_pools_nowhere():
    from pollen.worker.packed import padded

    batch = pack([np.arange(1, n, dtype=np.int32) for n in (40, 30, 9)], RowSpans.of([[(0, 20)], [(0, 29)], [(1, 8)]]))
    out = padded(batch, 32)
    assert out.tokens == 96 and batch.tokens == 76
    np.testing.assert_array_equal(out.cu_seqlens, [*batch.cu_seqlens, 96])
    assert (out.pool_index[76:] == batch.rows).all() and out.rows == batch.rows
    np.testing.assert_array_equal(out.positions[76:], np.arange(20))
    assert padded(out, 32) is out


def test_the_products_see_row_counts_of_a_few_sizes_only(tmp_path, monkeypatch):
    """oneDNN keeps a primitive per row count: batches of many sizes (and their pieces) reach the
    products as multiples of 32 rows; queries as they are."""
    from pollen.worker.models import cpu_linear

    make_tiny(tmp_path / "m")
    engine = EagerEngine(load_model(str(tmp_path / "m")), threads=2)
    seen = set()
    real = cpu_linear.PackedLinear.forward

    def forward(self, x):
        seen.add(x.shape[0])
        return real(self, x)

    monkeypatch.setattr(cpu_linear.PackedLinear, "forward", forward)
    rng = np.random.default_rng(4)
    for _ in range(20):
        engine.submit(pack([np.arange(1, n + 1, dtype=np.int32) for n in rng.integers(25, 60, rng.integers(3, 20))]))
    assert seen and all(rows % 32 == 0 for rows in seen), sorted(seen)
    seen.clear()
    engine.submit(pack([np.arange(1, 12, dtype=np.int32)]))  # a query: its own size
    assert seen == {11}
    engine.close()
