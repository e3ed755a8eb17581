"""Token-budget batching: order kept, budget honoured, requests split across batches."""
from __future__ import annotations

import numpy as np

from shared_mem import records
from worker.batcher import Batcher, Job


def job(req_id: int, lengths: list[int]) -> Job:
    seqs = [np.full(n, req_id, dtype=np.int32) for n in lengths]
    return Job.of(records.decode_request(memoryview(records.encode_request(req_id, 0, seqs, 0, False, 0))))


def test_batches_keep_order_and_budget():
    b = Batcher(max_batch_tokens=10)
    jobs = [job(1, [3, 3]), job(2, [5, 2, 2]), job(3, [10]), job(4, [1])]
    for j in jobs:
        b.add(j)
    assert b.queued_tokens == 26
    batches = []
    while b:
        batches.append([(j.rec.req_id, s, e) for j, s, e in b.next_batch()])
    assert batches == [[(1, 0, 2)], [(2, 0, 3)], [(3, 0, 1)], [(4, 0, 1)]]
    flat = [(r, i) for batch in batches for r, s, e in batch for i in range(s, e)]
    assert flat == [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 0), (4, 0)]
    for batch in batches:
        tokens = sum(int(sum(jobs[r - 1].rec.lengths[s:e])) for r, s, e in batch)
        assert tokens <= 10
    assert b.queued_tokens == 0


def test_a_request_larger_than_the_budget_is_split():
    b = Batcher(max_batch_tokens=8)
    b.add(job(1, [4] * 5))
    spans = [[(s, e) for _, s, e in b.next_batch()] for _ in range(3)]
    assert spans == [[(0, 2)], [(2, 4)], [(4, 5)]]
    assert not b


def test_records_round_trip():
    seqs = [np.array([101, 5, 102], np.int32), np.array([101, 102], np.int32)]
    rec = records.decode_request(memoryview(records.encode_request(7, 123, seqs, 32, True, 2)))
    assert (rec.req_id, rec.admit_ns, rec.dims, rec.normalize, rec.encoding) == (7, 123, 32, True, 2)
    assert rec.lengths.tolist() == [3, 2] and rec.ids.tolist() == [101, 5, 102, 101, 102]


def test_pack_lays_sequences_end_to_end_and_pools_spans():
    import torch

    from worker.models.pooling import pool_rows
    from worker.packed import pack

    seqs = [np.array([5, 6, 7], np.int32), np.array([8], np.int32), np.array([1, 2, 3, 4], np.int32)]
    whole = pack(seqs)
    assert whole.ids.tolist() == [5, 6, 7, 8, 1, 2, 3, 4]
    assert whole.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert whole.cu_seqlens.tolist() == [0, 3, 4, 8] and whole.max_seqlen == 4
    assert whole.pool_index.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]

    # Two rows out of the last sequence (its tokens 1..2 and 3..3); token 0 of it pools nowhere.
    spans = pack(seqs, [[(0, 3)], [(0, 1)], [(1, 3), (3, 4)]])
    assert spans.pool_index.tolist() == [0, 0, 0, 1, 4, 2, 2, 3]
    assert spans.pool_first.tolist() == [0, 3, 5, 7] and spans.pool_last.tolist() == [2, 3, 6, 7]
    hidden = torch.arange(16, dtype=torch.float32).view(8, 2)
    t = torch.from_numpy
    args = (t(spans.pool_index), t(spans.pool_first), t(spans.pool_last), t(spans.pool_count))
    mean = pool_rows(hidden, *args, "mean")
    assert mean.tolist() == [[2, 3], [6, 7], [11, 12], [14, 15]]
    assert pool_rows(hidden, *args, "last").tolist() == [[4, 5], [6, 7], [12, 13], [14, 15]]
    assert pool_rows(hidden, *args, "cls").tolist() == [[0, 1], [6, 7], [10, 11], [14, 15]]
