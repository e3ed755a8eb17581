"""Token-budget batching: order kept, budget (tokens and rows) honoured, requests split across batches."""
from __future__ import annotations

import numpy as np
import pytest

from pollen.common.request import LANES, Lane, RequestOptions
from pollen.shared_mem import records
from pollen.worker.batcher import Batcher, Job


def job(req_id: int, lengths: list[int]) -> Job:
    seqs = [np.full(n, req_id, dtype=np.int32) for n in lengths]
    return Job.of(records.decode_request(memoryview(records.encode_request(req_id, 0, seqs, RequestOptions()))))


def test_batches_keep_order_and_budget():
    b = Batcher(max_batch_tokens=10)
    jobs = [job(1, [3, 3]), job(2, [5, 2, 2]), job(3, [10]), job(4, [1])]
    for j in jobs:
        b.add(j)
    assert b.queued_tokens == 26
    batches = []
    while b:
        batches.append([(j.rec.req_id, s, e) for j, s, e in b.next_batch()])
    # Every request's sequences, each once and in order, and no batch over the budget.
    flat = [(r, i) for batch in batches for r, s, e in batch for i in range(s, e)]
    assert sorted(flat) == [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 0), (4, 0)]
    for r in (1, 2):
        assert [i for q, i in flat if q == r] == sorted(i for q, i in flat if q == r)
    for batch in batches:
        tokens = sum(int(sum(jobs[r - 1].rec.lengths[s:e])) for r, s, e in batch)
        assert tokens <= 10
        assert [r for r, _, _ in batch] == sorted(r for r, _, _ in batch)  # arrival order within a batch
    # The first batch gives every request that fits a share: the small request 4 is not kept
    # waiting behind requests 1 and 2 and the whole of 3.
    assert batches[0] == [(1, 0, 1), (2, 0, 1), (4, 0, 1)]
    assert b.queued_tokens == 0


def test_a_short_request_waits_about_one_batch_behind_a_huge_one():
    """A request of 400 windows queued first; a query arriving later goes into the very next batch
    (about one batch of waiting), and the huge request still fills the rest of each batch."""
    b = Batcher(max_batch_tokens=1024)
    b.add(job(1, [256] * 400))
    first = b.next_batch()
    assert [(j.rec.req_id, s, e) for j, s, e in first] == [(1, 0, 4)]
    b.add(job(2, [12]))
    second = [(j.rec.req_id, s, e) for j, s, e in b.next_batch()]
    assert (2, 0, 1) in second and second[0][0] == 1
    assert sum(e - s for r, s, e in second if r == 1) == 3  # the rest of the budget is the huge one's


def test_a_request_larger_than_the_budget_is_split():
    b = Batcher(max_batch_tokens=8)
    b.add(job(1, [4] * 5))
    spans = [[(s, e) for _, s, e in b.next_batch()] for _ in range(3)]
    assert spans == [[(0, 2)], [(2, 4)], [(4, 5)]]
    assert not b


def test_records_round_trip():
    seqs = [np.array([101, 5, 102], np.int32), np.array([101, 102], np.int32)]
    rec = records.decode_request(memoryview(records.encode_request(7, 123, seqs, RequestOptions(dims=32, normalize=True,
                                                                                            encoding=2))))
    o = rec.options
    assert (rec.req_id, rec.admit_ns, o.dims, o.normalize, o.encoding) == (7, 123, 32, True, 2)
    assert rec.lengths.tolist() == [3, 2] and rec.ids.tolist() == [101, 5, 102, 101, 102]


def test_pack_lays_sequences_end_to_end_and_pools_spans():
    import torch

    from pollen.worker.models.pooling import pool_rows
    from pollen.worker.packed import RowSpans, pack

    seqs = [np.array([5, 6, 7], np.int32), np.array([8], np.int32), np.array([1, 2, 3, 4], np.int32)]
    whole = pack(seqs)
    assert whole.ids.tolist() == [5, 6, 7, 8, 1, 2, 3, 4]
    assert whole.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert whole.cu_seqlens.tolist() == [0, 3, 4, 8] and whole.max_seqlen == 4
    assert whole.pool_index.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]

    # Two rows out of the last sequence (its tokens 1..2 and 3..3); token 0 of it pools nowhere.
    spans = pack(seqs, RowSpans.of([[(0, 3)], [(0, 1)], [(1, 3), (3, 4)]]))
    assert spans.pool_index.tolist() == [0, 0, 0, 1, 4, 2, 2, 3]
    assert spans.pool_first.tolist() == [0, 3, 5, 7] and spans.pool_last.tolist() == [2, 3, 6, 7]
    hidden = torch.arange(16, dtype=torch.float32).view(8, 2)
    t = torch.from_numpy
    args = (t(spans.pool_index), t(spans.pool_first), t(spans.pool_last), t(spans.pool_count))
    mean = pool_rows(hidden, *args, "mean")
    assert mean.tolist() == [[2, 3], [6, 7], [11, 12], [14, 15]]
    assert pool_rows(hidden, *args, "last").tolist() == [[4, 5], [6, 7], [12, 13], [14, 15]]
    assert pool_rows(hidden, *args, "cls").tolist() == [[0, 1], [6, 7], [10, 11], [14, 15]]


def test_pack_spans_match_a_span_by_span_layout():
    """Random disjoint spans (chunks, gaps, a row per token) laid out as a loop over the spans would."""
    from pollen.worker.packed import RowSpans, pack

    rng = np.random.default_rng(3)
    seqs, per_sequence = [], []
    for _ in range(30):
        n = int(rng.integers(1, 40))
        seqs.append(rng.integers(1, 1000, n, dtype=np.int32))
        cuts = np.sort(rng.choice(np.arange(n + 1), size=min(n + 1, int(rng.integers(2, 8))), replace=False))
        spans = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:]) if rng.random() < 0.8]
        per_sequence.append(spans or [(0, n)])
    per_sequence[0] = [(i, i + 1) for i in range(len(seqs[0]))]  # token vectors: a row per token
    batch = pack(seqs, RowSpans.of(per_sequence))
    starts = np.cumsum([0, *(len(s) for s in seqs)])
    flat = [(int(starts[i]) + a, int(starts[i]) + b) for i, spans in enumerate(per_sequence) for a, b in spans]
    index = np.full(int(starts[-1]), len(flat))
    for row, (a, b) in enumerate(flat):
        index[a:b] = row
    assert batch.pool_index.tolist() == index.tolist()
    assert batch.pool_first.tolist() == [a for a, _ in flat] and batch.pool_last.tolist() == [b - 1 for _, b in flat]
    assert batch.pool_count.tolist() == [b - a for a, b in flat]
    with pytest.raises(ValueError, match="at least one token"):
        pack(seqs[:1], RowSpans.of([[(2, 2)]]))


def lane_job(req_id: int, lengths: list[int], priority: int = 0, deadline_ns: int = 0) -> Job:
    seqs = [np.full(n, req_id, dtype=np.int32) for n in lengths]
    record = records.encode_request(req_id, 0, seqs, RequestOptions(lane=LANES[priority], deadline_ns=deadline_ns))
    return Job.of(records.decode_request(memoryview(record)))


def shape(batch):
    return [(j.rec.req_id, s, e) for j, s, e in batch]


def test_interactive_goes_first_and_bulk_fills_the_rest():
    b = Batcher(max_batch_tokens=30)
    b.add(lane_job(1, [10, 10, 10], priority=1))
    b.add(lane_job(2, [5, 5]))
    # Beside interactive work bulk gets one sequence; alone, the rest of the budget.
    assert shape(b.next_batch()) == [(2, 0, 2), (1, 0, 1)]
    assert shape(b.next_batch()) == [(1, 1, 3)]
    assert not b and b.queued_tokens == 0


def test_bulk_is_capped_but_never_starved():
    b = Batcher(max_batch_tokens=30, bulk_batch_tokens=10)
    b.add(lane_job(1, [10, 10], priority=1))
    b.add(lane_job(2, [10] * 6))
    # Interactive work would fill every batch; one bulk sequence still goes into each.
    assert shape(b.next_batch()) == [(2, 0, 2), (1, 0, 1)]
    assert shape(b.next_batch()) == [(2, 2, 4), (1, 1, 2)]
    assert shape(b.next_batch()) == [(2, 4, 6)]
    # The cap holds bulk work to one 10-token sequence per batch even with the budget free.
    b.add(lane_job(3, [10, 10, 10], priority=1))
    assert [shape(b.next_batch()) for _ in range(3)] == [[(3, 0, 1)], [(3, 1, 2)], [(3, 2, 3)]]
    # A bulk sequence longer than the cap still goes (alone): the cap never blocks the lane.
    b.add(lane_job(4, [25], priority=1))
    assert shape(b.next_batch()) == [(4, 0, 1)]


def test_rows_are_capped_like_tokens_and_a_carried_request_counts_its_answer():
    b = Batcher(max_batch_tokens=1000, max_batch_rows=5)
    b.add(lane_job(1, [1] * 7))
    b.add(lane_job(2, [1, 1]))
    # Five one-row texts; the other two of request 1 end it in the next batch, which also holds
    # request 1's whole answer (7 outputs): 2 + 7 rows, over the cap, but a batch always takes
    # its first sequence and the sequence before the last one does not end the request. Request 2
    # (two rows) fits beside that sequence; request 1's last one then goes alone: 1 + 7 rows.
    assert shape(b.next_batch()) == [(1, 0, 5)]
    assert shape(b.next_batch()) == [(1, 5, 6), (2, 0, 2)]
    assert shape(b.next_batch()) == [(1, 6, 7)]
    assert not b
    # The bulk sequence kept beside interactive work keeps its rows as well as its tokens.
    b.add(lane_job(3, [1, 1], priority=1))
    b.add(lane_job(4, [1] * 9))
    assert shape(b.next_batch()) == [(4, 0, 4), (3, 0, 1)]
    # Its last sequence ends request 3 (2 outputs): 3 rows kept for it.
    assert shape(b.next_batch()) == [(4, 4, 6), (3, 1, 2)]


def test_cancel_and_expire_take_out_only_requests_not_yet_batched():
    b = Batcher(max_batch_tokens=10)
    b.add(lane_job(1, [6, 6]))
    b.add(lane_job(2, [3], deadline_ns=100))
    b.add(lane_job(3, [3], priority=1, deadline_ns=500))
    b.add(lane_job(4, [3], priority=1))
    # Interactive first (request 2 does not fit beside request 1), then one bulk sequence.
    assert shape(b.next_batch()) == [(1, 0, 1), (3, 0, 1)]
    assert b.cancel(1) is None  # started: it finishes as usual
    assert b.cancel(3) is None  # batched whole: already at the model
    assert [j.rec.req_id for j in b.expire(now_ns=200)] == [2]
    assert b.cancel(4).rec.req_id == 4
    assert b.cancel(99) is None
    assert b.expire(now_ns=10**12) == []
    assert shape(b.next_batch()) == [(1, 1, 2)]
    assert not b and b.queued_tokens == 0 and b.with_deadline == 0


def test_records_carry_rows_priority_and_deadline():
    rows = records.RowPlan(np.array([0, 0, 1], np.uint32), np.array([1, 3, 0], np.uint32),
                           np.array([3, 5, 4], np.uint32), np.array([0, 1, 1], np.uint32),
                           np.array([1, 1, 2.5], np.float32))
    seqs = [np.arange(6, dtype=np.int32), np.arange(4, dtype=np.int32)]
    rec = records.decode_request(memoryview(records.encode_request(
        9, 1, seqs, RequestOptions(encoding=3, lane=Lane.BULK, deadline_ns=77), rows)))
    assert (rec.options.deadline_ns, rec.options.lane, rec.n_out, rec.options.encoding) == (77, 1, 2, 3)
    for name in ("seq", "start", "stop", "out", "weight"):
        np.testing.assert_array_equal(getattr(rec.rows, name), getattr(rows, name))
    assert rec.ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    job = Job.of(rec)
    spans = job.row_spans(0, 2)
    assert job.n_rows == 3 and spans.seq.tolist() == [0, 0, 1]
    assert spans.start.tolist() == [1, 3, 0] and spans.stop.tolist() == [3, 5, 4]
    assert job.row_spans(1, 2).seq.tolist() == [0]
    assert records.decode_cancel(memoryview(records.encode_cancel(9))) == 9


def test_combine_is_the_weighted_mean_and_int8_scales_round_trip():
    from pollen.common.encodings import row_bytes
    from pollen.v1 import embedder_pb2 as pb
    from pollen.worker.postprocess import combine, finish

    pooled = np.array([[1, 2], [3, 4], [5, -6]], np.float32)
    got = combine(pooled, np.array([0, 0, 1]), np.array([1.0, 3.0, 2.0]), 2)
    np.testing.assert_allclose(got, [[2.5, 3.5], [5, -6]])
    out = bytearray(2 * row_bytes(2, pb.ENCODING_INT8))
    finish(got, 0, False, pb.ENCODING_INT8, memoryview(out))
    q = np.frombuffer(bytes(out[:4]), np.int8).reshape(2, 2)
    scales = np.frombuffer(bytes(out[4:]), "<f4")
    np.testing.assert_allclose(scales, [3.5 / 127, 6 / 127], rtol=1e-6)
    assert q.tolist() == [[91, 127], [106, -127]]


def test_a_lone_request_takes_the_same_batches_with_and_without_the_shortcut(monkeypatch):
    """Batcher._take_lone_request (the lone query's shortcut) must give what the two passes give:
    the same spans, queued tokens and deadline count, batch after batch, for lone requests of
    every shape, budget and row cap, in each lane and mixed."""
    rng = np.random.default_rng(11)

    def batches(shortcut: bool, lengths, budget, bulk_cap, rows, lane, deadline):
        if not shortcut:
            monkeypatch.setattr(Batcher, "_take_lone_request", lambda *a: None)
        b = Batcher(budget, bulk_cap, rows)
        seqs = [np.full(n, 3, dtype=np.int32) for n in lengths]
        rec = records.decode_request(memoryview(records.encode_request(
            7, 0, seqs, RequestOptions(lane=LANES[lane or 0], deadline_ns=deadline))))
        b.add(Job.of(rec))
        out = []
        while b:
            spans = b.next_batch(lane)
            out.append(([(s, e) for _, s, e in spans], b.queued_tokens, b.with_deadline))
        monkeypatch.undo()
        return out

    taken = 0
    for _ in range(400):
        lengths = [int(n) for n in rng.integers(1, 40, rng.integers(1, 6))]
        budget = int(rng.integers(max(lengths), 120))
        case = (lengths, budget, int(rng.integers(0, 2)) * budget // 2, int(rng.integers(1, 8)),
                [None, 0, 1][rng.integers(0, 3)], int(rng.integers(0, 2)) * 10**18)
        with_it = batches(True, *case)
        assert with_it == batches(False, *case), case
        taken += len(with_it) == 1
    assert 50 < taken < 400  # both the shortcut's case and the two passes' were met


def test_a_large_interactive_request_beside_another_model_is_batched_in_the_bulk_lane():
    """worker/loop.py run_lane: with several models on one GPU, an interactive request over the
    limit goes to its model's bulk lane (low-priority stream), a query stays interactive."""
    from pollen.worker.loop import SHARED_GPU_INTERACTIVE_TOKENS, run_lane

    interactive, bulk = LANES
    large = SHARED_GPU_INTERACTIVE_TOKENS
    assert run_lane(interactive, large + 1, large) == bulk
    assert run_lane(interactive, large, large) == interactive
    assert run_lane(bulk, 10, large) == bulk
    assert run_lane(interactive, 10 * large, 0) == interactive  # one model: no request is large
    batcher = Batcher(max_batch_tokens=large)
    big, query = job(1, [large // 2, large // 2 + 1]), job(2, [12])
    batcher.add(big, run_lane(interactive, big.tokens(0, big.n_seqs), large))
    batcher.add(query, run_lane(interactive, query.tokens(0, query.n_seqs), large))
    assert [j.rec.req_id for j, _, _ in batcher.next_batch(interactive)] == [2]
    assert {j.rec.req_id for j, _, _ in batcher.next_batch(bulk)} == {1}
