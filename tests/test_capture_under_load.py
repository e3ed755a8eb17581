"""When the worker captures a graph a batch missed (worker/loop.py Worker.capture): at once while no
interactive work waits; under interactive load only a bucket met CAPTURE_UNDER_LOAD_HITS times,
at most once per CAPTURE_UNDER_LOAD_EVERY_NS, and never while an interactive batch is in flight
(interactive launches wait meanwhile, bulk ones go on). The engine is a stand-in that counts
captures (no GPU here: the CUDA engine's captures themselves are tests/test_cuda_engine.py's)."""
from __future__ import annotations

from collections import deque

from pollen.common.request import Lane
from pollen.worker import loop
from pollen.worker.batcher import Batcher
from pollen.worker.loop import CAPTURE_UNDER_LOAD_EVERY_NS, CAPTURE_UNDER_LOAD_HITS, Worker
from tests.test_batch_record import make_job


class CountingGraphEngine:
    """Stands in for the CUDA engine's capture bookkeeping: `hits` eager batches of one bucket."""

    side_by_side = True

    def __init__(self, hits: int = 0):
        self.hits = hits
        self.captures: list[int] = []  # the min_hits of each capture_one call that captured

    def wants_capture(self, min_hits: int) -> bool:
        return self.hits >= min_hits > 0

    def capture_one(self, min_hits: int = 0) -> bool:
        if not self.hits or self.hits < min_hits:
            return False
        self.captures.append(min_hits)
        self.hits = 0
        return True


def worker(engine) -> Worker:
    w = object.__new__(Worker)
    w.engine, w.side_by_side = engine, True
    w.open = (deque(), deque())
    w.batcher = Batcher(4096, 4096, 1 << 20)
    w.capture_pending, w.next_load_capture_ns = False, 0
    w.launched = []
    w.submit = lambda spans, lane: (w.launched.append(lane), w.open[lane].append(object()))
    return w


def test_with_no_interactive_work_any_missed_bucket_is_captured():
    w = worker(CountingGraphEngine(hits=1))
    assert w.capture(0) and w.engine.captures == [0]  # True: the worker then stores its graph counts
    assert not w.capture(1)  # nothing left to capture


def test_under_load_a_rarely_met_bucket_waits_for_the_lane_to_idle():
    w = worker(CountingGraphEngine(hits=CAPTURE_UNDER_LOAD_HITS - 1))
    w.batcher.add(make_job(1, [5]))
    w.capture(0)
    assert not w.capture_pending and w.engine.captures == []
    assert w.launch() and w.launched == [Lane.INTERACTIVE]


def test_under_load_an_often_met_bucket_is_captured_once_the_lane_s_batches_are_done(monkeypatch):
    w = worker(CountingGraphEngine(hits=CAPTURE_UNDER_LOAD_HITS))
    w.open[Lane.INTERACTIVE].append(object())  # an interactive batch in flight
    w.batcher.add(make_job(1, [5]))
    w.batcher.add(make_job(2, [5], priority=Lane.BULK))
    w.capture(0)
    assert w.capture_pending and w.engine.captures == []  # not while a batch is in flight
    assert w.launch() and w.launched == [Lane.BULK]  # the interactive lane waits; bulk goes on
    w.open[Lane.INTERACTIVE].clear()  # that batch is done and answered
    monkeypatch.setattr(loop.time, "monotonic_ns", lambda: 5)
    assert w.capture(1)
    assert w.engine.captures == [CAPTURE_UNDER_LOAD_HITS] and not w.capture_pending
    assert w.next_load_capture_ns == 5 + CAPTURE_UNDER_LOAD_EVERY_NS
    assert w.launch() and w.launched == [Lane.BULK, Lane.INTERACTIVE]  # interactive batches launch again


def test_under_load_captures_are_at_most_one_per_interval():
    w = worker(CountingGraphEngine(hits=CAPTURE_UNDER_LOAD_HITS))
    w.next_load_capture_ns = 10 * CAPTURE_UNDER_LOAD_EVERY_NS
    w.batcher.add(make_job(1, [5]))
    w.capture(w.next_load_capture_ns - 1)
    assert not w.capture_pending and w.engine.captures == []
    w.capture(w.next_load_capture_ns)
    assert w.engine.captures == [CAPTURE_UNDER_LOAD_HITS]
