"""Which captured graph runs a batch whose own bucket has none (CudaEngine.covering): the smallest
that holds it padded, with at most twice its bucket's tokens, enough sequences for its padding
sequence too, a longest sequence as long and enough rows; a batch of a row a token keeps its
sequences' bucket; and which missed bucket capture_one captures first.
Pure bookkeeping, so it runs here without a GPU, the captures recorded by a stand-in (the padded
run and the captures themselves are tests/test_cuda_engine.py's, on the device)."""
from __future__ import annotations

import numpy as np

from pollen.worker.cuda_engine import CudaEngine, DeviceLane, token_buckets
from pollen.worker.packed import RowSpans, pack


def lane_with(*shapes, wanted=(), padded=()) -> DeviceLane:
    lane = object.__new__(DeviceLane)
    lane.graphs = {shape: None for shape in shapes}
    lane.wanted = {shape: 1 for shape in wanted}
    lane.padded = {shape: 1 for shape in padded}
    return lane


def engine() -> CudaEngine:
    e = object.__new__(CudaEngine)
    e.buckets, e.max_positions, e.graphs_on = token_buckets(8192), 32768, True
    e.one_text_buckets, e.one_text_layouts = {}, {}
    e.counts = np.zeros(3, np.uint64)
    return e


def batch(*lengths):
    return pack([np.arange(1, n + 1, dtype=np.int32) for n in lengths])


def test_the_smallest_graph_that_holds_the_batch_is_chosen():
    b = batch(13, 14, 12)  # 39 tokens, 3 sequences
    shape = engine().bucket(b)
    assert shape == (48, 4, 16, 4)
    lane = lane_with((64, 4, 16, 4), (64, 8, 16, 8), (80, 4, 32, 4), (48, 2, 16, 2), (160, 4, 16, 4))
    assert CudaEngine.covering(lane, shape, b) == (64, 4, 16, 4)


def test_no_graph_with_more_than_twice_the_tokens_fewer_sequences_or_shorter_longest():
    b = batch(13, 14, 12)
    shape = engine().bucket(b)
    for too_small in ((112, 4, 16, 4), (64, 2, 16, 2), (64, 4, 8, 4), (64, 4, 16, 2)):
        assert CudaEngine.covering(lane_with(too_small), shape, b) is None, too_small
    assert CudaEngine.covering(lane_with(), shape, b) is None


def test_a_padded_graph_needs_a_sequence_for_the_padding():
    b = batch(16, 16, 16, 16)  # 64 tokens exactly: its own bucket pads nothing
    shape = engine().bucket(b)
    assert shape == (64, 4, 16, 4)
    # 80 tokens pad 16: four texts and the padding sequence need more than 4 sequences.
    assert CudaEngine.covering(lane_with((80, 4, 16, 4)), shape, b) is None
    assert CudaEngine.covering(lane_with((80, 4, 16, 4), (80, 8, 16, 8)), shape, b) == (80, 8, 16, 8)


def test_a_batch_of_a_row_a_token_has_a_row_bucket_of_its_own():
    """Token vectors: 39 tokens in 3 texts, a row each. The sequences' bucket stays 4 (the attention
    kernel's grid); the rows get the tokens' bucket, 48 (a row holds at least a token). A graph with
    as many sequence slots as rows is not needed."""
    lengths = (13, 14, 12)
    docs = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    b = pack(docs, RowSpans(np.repeat(np.arange(3), lengths), np.concatenate([np.arange(n) for n in lengths]),
                            np.concatenate([np.arange(1, n + 1) for n in lengths])))
    assert b.rows == 39
    shape = engine().bucket(b)
    assert shape == (48, 4, 16, 48)
    lane = lane_with((64, 4, 16, 4), (64, 64, 16, 64), (64, 4, 16, 64))
    assert CudaEngine.covering(lane, shape, b) == (64, 4, 16, 64)


def test_capture_one_takes_eager_buckets_first_then_padded_ones_interactive_lane_first():
    e = engine()
    interactive = lane_with(padded=[(32, 2, 16, 2)])
    bulk = lane_with(wanted=[(8192, 64, 512, 64)], padded=[(8192, 32, 512, 32)])
    e.lanes = (interactive, bulk)
    captured = []

    def capture(shape, lane_index=0):  # stands in for the graph capture, keeping no graph
        captured.append((shape, lane_index))
        e.keep(lane_index, shape, None)

    e.capture = capture
    while e.capture_one():
        pass
    assert captured == [((8192, 64, 512, 64), 1), ((32, 2, 16, 2), 0), ((8192, 32, 512, 32), 1)]
    assert e.counts.tolist() == [0, 0, 3]  # the graphs held, for /metrics


def test_a_covering_graph_never_crosses_the_fp8_threshold():
    """With fp8 products from 961 tokens on (worker/models/fp8.py), a batch of bucket 960 runs
    padded in no graph of 961 tokens or more: it would take other products than its own bucket."""
    from types import SimpleNamespace

    from pollen.worker.models.fp8 import Choice

    b = batch(*[480, 470])
    shape = engine().bucket(b)
    assert shape[0] == 960
    lane = lane_with((1200, 4, 512, 4))
    assert CudaEngine.covering(lane, shape, b) == (1200, 4, 512, 4)
    model = SimpleNamespace(fp8_choice=Choice(961, ()))
    assert CudaEngine.covering(lane, shape, b, model) is None
    assert CudaEngine.covering(lane, shape, b, SimpleNamespace(fp8_choice=Choice(2000, ()))) == (1200, 4, 512, 4)
