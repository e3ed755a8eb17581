"""A lone query's shortcuts on the host (worker/packed.py `_pack_one`, CudaEngine.bucket and
`fill_one_text`): the same batch arrays, bucket and pinned layout as the general path, for every
length up to past the cap, and nothing shared is ever written. Host-side bookkeeping only, so it
runs here without a GPU on an engine object made without CUDA (its GPU side is
tests/test_cuda_engine.py's, on the device)."""
from __future__ import annotations

import numpy as np
import pytest

from pollen.worker.cuda_engine import CudaEngine, token_buckets
from pollen.worker.packed import ONE_TEXT_SHARED_MAX, RowSpans, pack


def engine_without_cuda(max_tokens: int, max_positions: int) -> CudaEngine:
    e = object.__new__(CudaEngine)
    e.buckets, e.max_positions, e.graphs_on = token_buckets(max_tokens), max_positions, True
    e.one_text_buckets, e.one_text_layouts = {}, {}
    return e


def general_pack(seq: np.ndarray):
    """The general packing of one text: pack() with an explicit whole-text row span."""
    return pack([seq], RowSpans.of([[(0, len(seq))]]))


@pytest.mark.parametrize("max_tokens,max_positions", [(16384, 32768), (4096, 40)])
def test_one_text_takes_the_general_bucket_and_layout_at_every_length(max_tokens, max_positions):
    e = engine_without_cuda(max_tokens, max_positions)
    rng = np.random.default_rng(7)
    for n in range(1, ONE_TEXT_SHARED_MAX + 8):
        seq = rng.integers(1, 50_000, n, dtype=np.int32)
        quick, slow = pack([seq]), general_pack(seq)
        for name in ("ids", "positions", "cu_seqlens", "pool_index", "pool_first", "pool_last", "pool_count"):
            assert np.array_equal(getattr(quick, name), getattr(slow, name)), (n, name)
        shape = e.bucket(quick)
        assert shape == e.bucket_of(n, 1, 1, n)
        for normalize in (None, np.ones(1, np.int32), np.zeros(1, np.int32)):
            for _ in range(2):  # the first call lays the layout out, the second copies it
                fast, general = np.full(1 << 16, -7, np.int32), np.full(1 << 16, -7, np.int32)
                used = e.fill(fast, quick, shape, normalize)
                assert used == e.fill_general(general, slow, shape, normalize)
                assert np.array_equal(fast, general), (n, normalize)
    assert len(e.one_text_buckets) == ONE_TEXT_SHARED_MAX  # bounded: lengths past the cap are not kept
    assert len(e.one_text_layouts) == ONE_TEXT_SHARED_MAX  # one layout a length here: each ran in its own bucket


def test_the_shared_arrays_of_a_length_are_not_written_by_filling():
    e = engine_without_cuda(4096, 32768)
    first = pack([np.arange(1, 15, dtype=np.int32)])
    kept = [a.copy() for a in (first.positions, first.cu_seqlens, first.pool_index, first.pool_first,
                               first.pool_last, first.pool_count)]
    for seq in (np.arange(100, 114, dtype=np.int32), np.arange(200, 214, dtype=np.int32)):
        b = pack([seq])
        assert b.positions is first.positions  # shared, by design
        e.fill(np.zeros(1 << 16, np.int32), b, e.bucket(b), np.ones(1, np.int32))
        e.fill_general(np.zeros(1 << 16, np.int32), b, e.bucket(b), None)
    for before, now in zip(kept, (first.positions, first.cu_seqlens, first.pool_index, first.pool_first,
                                  first.pool_last, first.pool_count)):
        assert np.array_equal(before, now)


def test_a_one_text_batch_with_a_partial_row_span_takes_the_general_layout():
    e = engine_without_cuda(4096, 32768)
    seq = np.arange(1, 21, dtype=np.int32)
    partial = pack([seq], RowSpans.of([[(2, 12)]]))  # one row over part of the text: not the shortcut's case
    assert not e.one_text(partial)
    shape = e.bucket(partial)
    a, b = np.zeros(1 << 16, np.int32), np.zeros(1 << 16, np.int32)
    assert e.fill(a, partial, shape, None) == e.fill_general(b, partial, shape, None)
    assert np.array_equal(a, b)
