"""How the worker launches a deep interactive queue (worker/loop.py, Worker.launch): with nothing
in flight, half of it and then the rest, as two batches in flight; a shallow queue, or one met
while a batch runs, as one batch. The engine is a stand-in that records the batches (no GPU here;
the launch policy is the worker's alone)."""
from __future__ import annotations

from collections import deque

from pollen.common.worker_config import DEFAULT_SPLIT_TOKENS as SPLIT_MIN_TOKENS
from pollen.worker.batcher import BULK, INTERACTIVE, Batcher
from pollen.worker.loop import Worker
from tests.test_batch_record import make_job

QUERY = 14  # tokens of one query


def worker(max_batch_tokens: int = 32768, split_tokens: int = SPLIT_MIN_TOKENS) -> Worker:
    w = object.__new__(Worker)
    w.side_by_side, w.capture_pending, w.split_tokens = True, False, split_tokens
    w.open = (deque(), deque())
    w.batcher = Batcher(max_batch_tokens, 8192, 1 << 20)
    w.batches_seen = []
    w.submit = lambda spans, lane: (w.batches_seen.append((lane, sum(j.tokens(a, b) for j, a, b in spans))),
                                    w.open[lane].append(object()))
    return w


def queue(w: Worker, n: int, first_id: int = 0, priority: int = INTERACTIVE) -> None:
    for i in range(n):
        w.batcher.add(make_job(first_id + i, [QUERY], priority=priority))


def test_a_deep_queue_with_nothing_in_flight_goes_as_two_halves():
    w = worker()
    n = 2 * SPLIT_MIN_TOKENS // QUERY + 2  # about two thresholds' worth of queries
    queue(w, n)
    assert w.launch() and w.launch() and not w.launch()  # two in flight: the lane is full
    (lane1, first), (lane2, second) = w.batches_seen
    assert lane1 == lane2 == INTERACTIVE and first + second == n * QUERY
    assert abs(first - second) <= QUERY and not w.batcher


def test_a_shallow_queue_goes_as_one_batch():
    w = worker()
    queue(w, SPLIT_MIN_TOKENS // QUERY - 1)  # just under the threshold
    assert w.launch() and w.batches_seen == [(INTERACTIVE, (SPLIT_MIN_TOKENS // QUERY - 1) * QUERY)]
    assert not w.batcher


def test_with_a_batch_in_flight_the_next_takes_the_whole_queue():
    w = worker()
    w.open[INTERACTIVE].append(object())
    queue(w, 4 * SPLIT_MIN_TOKENS // QUERY)
    assert w.launch() and w.batches_seen == [(INTERACTIVE, 4 * SPLIT_MIN_TOKENS // QUERY * QUERY)]


def test_the_halves_keep_the_token_budget_and_bulk_is_not_split():
    w = worker(max_batch_tokens=3000)
    queue(w, 1000)  # 14,000 tokens: far over two budgets, so each batch is a full budget
    queue(w, 1000, first_id=5000, priority=BULK)
    assert w.launch()
    assert w.batches_seen == [(INTERACTIVE, 3000 // QUERY * QUERY), (BULK, 8192 // QUERY * QUERY)]


def test_split_tokens_zero_never_splits():
    w = worker(split_tokens=0)
    queue(w, 4 * SPLIT_MIN_TOKENS // QUERY)
    assert w.launch() and w.batches_seen == [(INTERACTIVE, 4 * SPLIT_MIN_TOKENS // QUERY * QUERY)]
