"""When the CUDA engine captures a graph a batch missed (worker/cuda_engine.py, between_batches): at
once while no interactive work waits; under interactive load only a bucket met
CAPTURE_UNDER_LOAD_HITS times, at most once per CAPTURE_UNDER_LOAD_EVERY_NS, and never while an
interactive batch is in flight (interactive launches wait meanwhile, bulk ones go on: the loop's
half, worker/loop.py launch). No GPU here: the engine's bookkeeping runs as it is and a stand-in
records its captures (the captures themselves are tests/test_cuda_engine.py's)."""
from __future__ import annotations

import numpy as np

from pollen.common.request import Lane
from pollen.worker import cuda_engine
from pollen.worker.batcher import Batcher
from pollen.worker.cuda_engine import CAPTURE_UNDER_LOAD_EVERY_NS, CAPTURE_UNDER_LOAD_HITS, CudaEngine
from pollen.worker.loop import Worker
from pollen.worker.model_slot import ModelSlot
from tests.test_batch_record import make_job
from tests.test_graph_cover import lane_with

FIRST, OFTEN = (16, 2, 16), (32, 2, 32)  # the interactive lane's first missed bucket; its most met one


def engine(**wanted: int) -> CudaEngine:
    """An engine whose interactive lane ran these buckets eagerly so many times ({"first": n, "often": m})."""
    e = object.__new__(CudaEngine)
    e.lanes = (lane_with(), lane_with())
    e.lanes[Lane.INTERACTIVE].wanted = {{"first": FIRST, "often": OFTEN}[name]: n for name, n in wanted.items()}
    e.counts = np.zeros(3, np.uint64)
    e.capture_pending, e.next_load_capture_ns = False, 0
    e.captured = []
    e.capture = lambda shape, lane_index=Lane.INTERACTIVE: (e.captured.append(shape), e.keep(lane_index, shape, None))
    return e


def test_with_no_interactive_work_any_missed_bucket_is_captured():
    e = engine(first=1)
    counts = np.zeros(3, np.uint64)
    e.keep_counts_in(counts)
    assert not e.between_batches(False, False, 0) and e.captured == [FIRST]
    assert counts.tolist() == [0, 0, 1]  # what /metrics reads
    e.between_batches(False, False, 1)
    assert e.captured == [FIRST]  # nothing left to capture


def test_under_load_a_rarely_met_bucket_waits_for_the_lane_to_idle():
    e = engine(often=CAPTURE_UNDER_LOAD_HITS - 1)
    assert not e.between_batches(True, False, 0)
    assert not e.capture_pending and e.captured == []


def test_under_load_an_often_met_bucket_is_captured_once_the_lane_s_batches_are_done(monkeypatch):
    e = engine(first=1, often=CAPTURE_UNDER_LOAD_HITS)
    assert e.between_batches(True, True, 0)  # interactive launches wait ...
    assert e.between_batches(True, True, 0) and e.captured == []  # ... and no capture while a batch is in flight
    monkeypatch.setattr(cuda_engine.time, "monotonic_ns", lambda: 5)
    assert not e.between_batches(True, False, 1)  # that batch is done: the capture, then launches go on
    assert e.captured == [OFTEN] and not e.capture_pending  # the most met bucket, not the first missed
    assert e.next_load_capture_ns == 5 + CAPTURE_UNDER_LOAD_EVERY_NS


def test_under_load_captures_are_at_most_one_per_interval():
    e = engine(often=CAPTURE_UNDER_LOAD_HITS)
    e.next_load_capture_ns = 10 * CAPTURE_UNDER_LOAD_EVERY_NS
    assert not e.between_batches(True, False, e.next_load_capture_ns - 1)
    assert not e.capture_pending and e.captured == []
    e.between_batches(True, False, e.next_load_capture_ns)
    assert e.captured == [OFTEN]


def test_while_the_engine_holds_interactive_launches_bulk_ones_go_on():
    w = object.__new__(Worker)
    holding = type("Holding", (), {"hold": True, "between_batches": lambda self, *args: self.hold})()
    slot = ModelSlot(0, None, holding, 0, Batcher(4096, 4096, 1 << 20))
    w.side_by_side, w.slots = True, [slot]
    w.launched = []
    w.launch_batch = lambda slot, spans, lane: (w.launched.append(lane), slot.open[lane].append(object()))
    slot.batcher.add(make_job(1, [5]))
    slot.batcher.add(make_job(2, [5], priority=Lane.BULK))
    assert w.launch(0) and w.launched == [Lane.BULK]
    holding.hold = False
    assert w.launch(0) and w.launched == [Lane.BULK, Lane.INTERACTIVE]
