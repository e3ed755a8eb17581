"""The BATCH_RESULT record (shared_mem/records.py) as the worker plans and fills it
(worker/batch_answer.py) and the frontend decodes it, without a model: a stand-in engine writes
known rows into the raw area, normalizing the flagged ones with the engines' own function.

Every kind of request is checked against postprocess.finish on its rows: the common float32 case
(answered by its raw rows, normalized or not), Matryoshka cuts, every encoding, native int8,
contextual chunks, CHUNK_MEAN, requests spread over several batches, and failed batches. The
row cap keeps every record within the ring's max_record. Then the worker's own launch_batch/answer
loop on a real ring: a failed batch, and a ring too small for two open records.
"""
from __future__ import annotations

import os
import threading
import types
from collections import deque

import numpy as np
import pytest
import torch

from pollen.common.encodings import row_bytes
from pollen.common.request import LANES, Lane, RequestOptions, Task
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring
from pollen.v1 import embedder_pb2 as pb
from pollen.worker.batch_answer import EARLIER_FAILURE, BatchAnswer
from pollen.worker.batcher import Batcher, Job
from pollen.worker.models.pooling import normalize_rows
from pollen.worker.postprocess import combine, finish

HIDDEN = 16
ENCODINGS = (pb.ENCODING_FLOAT32, pb.ENCODING_FLOAT16, pb.ENCODING_BFLOAT16, pb.ENCODING_INT8,
             pb.ENCODING_UBINARY)


def make_job(req_id: int, lengths: list[int], dims: int = 0, normalize: bool = False,
             encoding: int = pb.ENCODING_FLOAT32, rows: records.RowPlan | None = None, priority: int = 0) -> Job:
    seqs = [np.arange(n, dtype=np.int32) + 5 for n in lengths]
    data = records.encode_request(req_id, 1_000, seqs, RequestOptions(Task.EMBED, dims, normalize, encoding, LANES[priority]),
                                  rows)
    return Job.of(records.decode_request(memoryview(data)))


def chunk_plan(n_chunks: int, length: int) -> records.RowPlan:
    """One sequence of `length` tokens cut into `n_chunks` rows, one output each."""
    cuts = np.linspace(0, length, n_chunks + 1).astype(np.uint32)
    return records.RowPlan(np.zeros(n_chunks, np.uint32), cuts[:-1], cuts[1:], np.arange(n_chunks, dtype=np.uint32),
                           np.ones(n_chunks, np.float32))


def window_plan(windows_per_text: list[int]) -> records.RowPlan:
    """CHUNK_MEAN: each text is several one-row sequences (windows) sharing one output."""
    n = sum(windows_per_text)
    out = np.repeat(np.arange(len(windows_per_text)), windows_per_text).astype(np.uint32)
    return records.RowPlan(np.arange(n, dtype=np.uint32), np.zeros(n, np.uint32), np.full(n, 3, np.uint32), out,
                           np.linspace(1, 3, n).astype(np.float32))


def token_plan(lengths: list[int]) -> records.RowPlan:
    """Token vectors: every token of every sequence a row and an output of its own."""
    seq = np.repeat(np.arange(len(lengths)), lengths).astype(np.uint32)
    start = np.concatenate([np.arange(n) for n in lengths]).astype(np.uint32)
    n = len(seq)
    return records.RowPlan(seq, start, start + 1, np.arange(n, dtype=np.uint32), np.ones(n, np.float32))


def pooled_rows(job: Job) -> np.ndarray:
    """The rows a model would pool for this job: fixed by its id; every fifth one zero."""
    rng = np.random.default_rng(job.rec.req_id)
    rows = rng.standard_normal((job.n_rows, HIDDEN)).astype(np.float32) * 3
    rows[::5] = 0
    return rows


def run_batch(spans, error: Exception | None = None) -> tuple[BatchAnswer, bytearray, list[Job]]:
    """Plan a batch, let the stand-in engine write its raw area, fill and return the record."""
    plan = BatchAnswer(spans, HIDDEN)
    buf = bytearray(plan.nbytes)
    raw = plan.raw_rows(memoryview(buf))
    for (job, a, b), row in zip(spans, plan.first_row):
        ra, rb = job.row_offsets[a], job.row_offsets[b]
        raw[row:row + rb - ra] = pooled_rows(job)[ra:rb]
    raw[:] = normalize_rows(torch.from_numpy(raw.copy()), torch.from_numpy(plan.normalize)).numpy()
    unanswered = plan.fill(memoryview(buf), error, 2_000, 5_000)
    return plan, buf, unanswered


def reference(job: Job) -> bytes:
    rec = job.rec
    vectors = pooled_rows(job)
    if rec.rows is not None:
        vectors = combine(vectors, rec.rows.out.astype(np.int64), rec.rows.weight.astype(np.float64), rec.n_out)
    out = bytearray(rec.n_out * row_bytes(rec.options.dims or HIDDEN, rec.options.encoding))
    finish(vectors, rec.options.dims, rec.options.normalize, rec.options.encoding, memoryview(out))
    return bytes(out)


def every_kind() -> list[Job]:
    jobs = [make_job(1, [3, 4]), make_job(2, [5, 1, 2], normalize=True)]
    req_id = 3
    for encoding in ENCODINGS:
        for dims in (0, 8):
            for normalize in (False, True):
                jobs.append(make_job(req_id, [4, 2], dims, normalize, encoding))
                req_id += 1
    jobs.append(make_job(req_id, [12], normalize=True, rows=chunk_plan(4, 12)))
    jobs.append(make_job(req_id + 1, [3] * 6, dims=8, normalize=True, encoding=pb.ENCODING_INT8,
                         rows=window_plan([1, 3, 2])))
    jobs.append(make_job(req_id + 2, [2] * 30, normalize=True))  # larger than one batch
    jobs.append(make_job(req_id + 3, [3] * 6, normalize=True, rows=window_plan([4, 2])))
    jobs.append(make_job(req_id + 4, [5, 3], rows=token_plan([5, 3])))
    return jobs


def test_every_kind_of_request_equals_finish_on_its_rows():
    jobs = every_kind()
    batcher = Batcher(max_batch_tokens=40)
    for job in jobs:
        batcher.add(job)
    answers, direct, spread = {}, set(), set()
    while batcher:
        spans = batcher.next_batch()
        plan, buf, unanswered = run_batch(spans)
        assert unanswered == []
        report, results = records.decode_batch_result(memoryview(bytes(buf)))
        assert (report.tokens, report.seqs, report.rows) == (plan.tokens, plan.seqs, plan.rows)
        for entry in plan.entries:
            if entry.direct:  # its answer is its raw rows: nobody copied or wrote them
                assert plan.raw_at <= entry.body_at < plan.raw_at + 4 * HIDDEN * plan.rows
                direct.add(entry.job.rec.req_id)
        for (job, a, b) in spans:
            if a > 0 or b < job.n_seqs:
                spread.add(job.rec.req_id)
        for result in results:
            assert result.status == records.OK and (result.queue_us, result.inference_us) == (1, 3)
            answers[result.req_id] = result
    # Both paths and requests spread over batches ran; chunks and token vectors, a row per output,
    # are answered by their raw rows too (no combine, no copy).
    chunks, tokens = jobs[-5].rec.req_id, jobs[-1].rec.req_id
    assert len(spread) >= 2 and {1, 2, chunks, tokens} <= direct
    for job in jobs:
        rec, got = job.rec, answers[job.rec.req_id]
        assert (got.rows, got.dims, got.encoding) == (rec.n_out, rec.options.dims or HIDDEN, rec.options.encoding)
        want = reference(job)
        if rec.req_id in direct:  # normalized on the "device": equal to float32 rounding
            np.testing.assert_allclose(np.frombuffer(got.body, "<f4"), np.frombuffer(want, "<f4"),
                                       rtol=1e-6, atol=1e-7)
        else:
            assert got.body == want, f"request {rec.req_id}"


def test_native_int8_rows_are_never_normalized():
    job = make_job(1, [3, 3], normalize=True, encoding=pb.ENCODING_INT8)
    plan = BatchAnswer([(job, 0, 2)], HIDDEN, native_int8=True)
    assert not plan.normalize.any() and not plan.entries[0].direct
    buf = bytearray(plan.nbytes)
    plan.raw_rows(memoryview(buf))[:] = pooled_rows(job)
    plan.fill(memoryview(buf), None, 0, 0)
    (result,) = records.decode_batch_result(memoryview(bytes(buf)))[1]
    q = np.frombuffer(result.body, np.int8, count=2 * HIDDEN).reshape(2, HIDDEN)
    np.testing.assert_array_equal(q, np.round(127 * np.tanh(pooled_rows(job).astype(np.float64))))


def test_a_failed_batch_answers_internal_with_its_message():
    whole, spread = make_job(1, [4, 4]), make_job(2, [10, 10, 10])
    first = [(whole, 0, 2), (spread, 0, 1)]
    plan, buf, unanswered = run_batch(first, RuntimeError("out of memory"))
    report, results = records.decode_batch_result(memoryview(bytes(buf)))
    assert [(r.req_id, r.status, r.body) for r in results] == [
        (1, records.INTERNAL, b"model failed on this batch: out of memory")]
    assert report.rows == plan.rows == 3
    assert unanswered == [spread]  # its answer would come in a later batch: answered on its own
    # A later batch completing the failed request answers it INTERNAL again (the frontend
    # ignores a second answer) and does not count it twice.
    _, buf, unanswered = run_batch([(spread, 1, 3), (make_job(3, [2]), 0, 1)])
    results = records.decode_batch_result(memoryview(bytes(buf)))[1]
    assert [(r.req_id, r.status) for r in results] == [(2, records.INTERNAL), (3, records.OK)]
    assert results[0].body == EARLIER_FAILURE.encode() and unanswered == []
    huge = RuntimeError("x" * 5000)
    results = records.decode_batch_result(memoryview(bytes(run_batch([(make_job(4, [2]), 0, 1)], huge)[1])))[1]
    assert len(results[0].body) == records.ERROR_ROOM


def test_row_cap_keeps_every_record_within_max_record():
    """Random traffic in both lanes (short texts, many-chunk documents, CHUNK_MEAN, requests that
    span batches): under the cap max_batch_rows derives from a ring, no record exceeds that ring's
    max_record and the cap binds. The worst case, one-token one-text requests, comes within a row
    of max_record."""
    max_record = Ring.max_record_for(64 << 10)
    cap = records.max_batch_rows(max_record, HIDDEN)
    rng = np.random.default_rng(11)
    batcher = Batcher(max_batch_tokens=4096, max_batch_rows=cap)
    largest = 0
    for req_id in range(1, 3000):
        kind = rng.integers(0, 4)
        priority = int(rng.integers(0, 2))
        if kind == 0:
            job = make_job(req_id, [1] * int(rng.integers(1, 8)), encoding=int(rng.choice(ENCODINGS)),
                           priority=priority)
        elif kind == 1:
            n = int(rng.integers(1, 64))
            job = make_job(req_id, [n], rows=chunk_plan(n, n), priority=priority)
        elif kind == 2:
            windows = rng.integers(1, 4, int(rng.integers(1, 20))).tolist()
            job = make_job(req_id, [3] * sum(windows), rows=window_plan(windows), priority=priority)
        else:
            job = make_job(req_id, rng.integers(1, 20, int(rng.integers(1, 64))).tolist(), priority=priority)
        batcher.add(job)
        while batcher and (rng.random() < 0.02 or req_id == 2999):
            plan = BatchAnswer(batcher.next_batch(), HIDDEN)
            assert plan.nbytes <= max_record
            largest = max(largest, plan.rows)
    assert largest == cap
    for req_id in range(5000, 5000 + 2 * cap):
        batcher.add(make_job(req_id, [1]))
    plan = BatchAnswer(batcher.next_batch(), HIDDEN)
    assert max_record - (4 * HIDDEN + records.ENTRY.itemsize) < plan.nbytes <= max_record


def test_a_response_ring_too_small_for_one_request_is_refused_at_start():
    from pollen.common.model_spec import default_model_path, read_model_spec
    from pollen.server.config import ServeConfig
    from pollen.server.process.app import check_limits

    spec = read_model_spec(default_model_path())  # 384 values a row: 20 rows fit a 64 KiB ring's record
    check_limits(ServeConfig(response_ring_bytes=64 << 10, max_texts_per_request=16), [spec])
    with pytest.raises(ValueError, match="--response-ring-bytes 65536 is too small"):
        check_limits(ServeConfig(response_ring_bytes=64 << 10, max_texts_per_request=64), [spec])


class FailingEngine:
    """Runs like the CPU engine would, except on batches holding the poisoned request id."""

    def __init__(self, poison: int):
        self.poison = poison
        self.batches = 0

    def submit(self, batch, out, normalize, lane=0):
        self.batches += 1
        if any(int(i) == self.poison for i in batch.ids):
            raise RuntimeError("poisoned batch")
        for part in out:  # one array per frontend the batch holds requests of
            part[:] = 1.0

        from pollen.worker.cpu_engine import ReadyRows

        return ReadyRows(out)


@pytest.fixture
def worker():
    """A Worker without a model, a supervisor or a frontend: one real response ring, stand-in engine."""
    from pollen.common import control
    from pollen.shared_mem.server_state import ServerState
    from pollen.worker.links import Link
    from pollen.worker.loop import Worker
    from pollen.worker.model_slot import ModelSlot

    w = object.__new__(Worker)
    link = object.__new__(Link)
    link.frontend, link.gone = 0, False
    link.responses = Ring.create(64 << 10, prefix="pollentest")
    w.links = {0: link}
    spec = types.SimpleNamespace(output_dims=HIDDEN, native_int8=False)  # what the loop reads of a model's spec
    w.slots = [ModelSlot(0, spec, None, 0)]
    w.batches, w.side_by_side, w.hold_records = 0, False, True
    w.state = ServerState.create(1, 1, prefix="pollentest")
    w.control, peer = control.pair()
    w.control_queue = deque()
    w.cfg = type("Cfg", (), {"index": 0, "parent_pid": os.getppid()})()
    yield w
    link.responses.close()
    link.responses.unlink()
    w.state.close()
    w.state.unlink()
    peer.close()
    w.control.close()


def read_all(ring: Ring) -> list:
    out = []
    while (item := ring.read()) is not None:
        kind, view = item
        out.append((kind, records.decode_batch_result(view) if kind == records.BATCH_RESULT
                    else records.decode_result(view)))
        del view
    ring.release()
    return out


def test_worker_fails_a_batch_alone_and_answers_requests_it_cuts(worker):
    worker.slots[0].engine = FailingEngine(poison=999)
    spread = make_job(1, [4, 4, 4])
    spread.rec.ids[4] = 999  # its second sequence poisons the batch that holds it
    fine = make_job(2, [3])
    worker.launch_batch(worker.slots[0], [(fine, 0, 1), (spread, 0, 1)], 0)
    worker.answer(worker.slots[0].open[0].popleft())
    worker.launch_batch(worker.slots[0], [(spread, 1, 2)], 0)
    worker.answer(worker.slots[0].open[0].popleft())
    worker.launch_batch(worker.slots[0], [(spread, 2, 3)], 0)
    worker.answer(worker.slots[0].open[0].popleft())
    got = read_all(worker.links[0].responses)
    kinds = [k for k, _ in got]
    assert kinds == [records.BATCH_RESULT, records.BATCH_RESULT, records.RESULT, records.BATCH_RESULT]
    assert [(r.req_id, r.status) for r in got[0][1][1]] == [(2, records.OK)]
    assert got[1][1][1] == []  # the failed batch completes nobody ...
    assert (got[2][1].req_id, got[2][1].status) == (1, records.INTERNAL)  # ... its request is answered alone
    assert "poisoned batch" in got[2][1].body.decode()
    assert [(r.req_id, r.status) for r in got[3][1][1]] == [(1, records.INTERNAL)]


def test_worker_commits_its_open_record_when_the_ring_cannot_hold_two(worker):
    """Two open batch records do not fit this ring: the worker finishes the first batch before
    it holds the second one's record, instead of waiting on itself."""
    worker.slots[0].engine = FailingEngine(poison=-1)
    rows = (worker.links[0].responses.max_record - records.raw_at(1)) // (4 * HIDDEN)  # over half the ring, with the error
    first, second = make_job(1, [1] * rows), make_job(2, [1] * rows)
    worker.launch_batch(worker.slots[0], [(first, 0, rows)], 0)
    assert len(worker.slots[0].open[0]) == 1
    worker.write_error(make_job(3, [1]), "cancelled " * 20, records.CANCELLED)  # goes after the open record
    assert read_all(worker.links[0].responses) == []
    got = []

    def frontend():
        assert worker.links[0].responses.wait_readable(timeout=10)
        got.extend(read_all(worker.links[0].responses))

    reader = threading.Thread(target=frontend)
    reader.start()
    worker.launch_batch(worker.slots[0], [(second, 0, rows)], 0)  # room only once the first record is committed and read
    reader.join(10)
    assert [b.shares[0].plan.spans[0][0] for b in worker.slots[0].open[0]] == [second]
    assert [k for k, _ in got] == [records.BATCH_RESULT, records.RESULT]
    worker.answer(worker.slots[0].open[0].popleft())
    ((kind, (report, results)),) = read_all(worker.links[0].responses)
    assert report.rows == rows and results[0].req_id == 2


class LaterEngine:
    """A stand-in for the CUDA engine (no GPU here): runs the two lanes side by side, each batch
    done only when the test says so; bulk rows come back in the engine's own buffer."""

    side_by_side = True

    def __init__(self):
        self.pending = []

    def submit(self, batch, out, normalize, lane=0):
        engine = self

        class Later:
            finished = False

            def done(self):
                return self.finished

            def result(self):
                assert self.finished, "the worker waited on a batch that is not done"
                rows = np.full((batch.rows, HIDDEN), 1.0 + lane, np.float32)
                if out is None:
                    return rows
                for part in out:
                    part[:] = rows[:len(part)]
                return out

        later = Later()
        engine.pending.append(later)
        return later


def test_side_by_side_a_bulk_batch_holds_no_record_and_never_delays_an_interactive_one(worker):
    """The interactive lane's record is held at launch and published when its batch is done,
    even while a bulk batch launched before it still runs: that one takes its record only when
    done (a held record would keep every later record in the ring unpublished)."""
    engine = worker.slots[0].engine = LaterEngine()
    worker.side_by_side = True
    ring = worker.links[0].responses
    bulk, query = make_job(1, [4] * 6, priority=1), make_job(2, [3])
    worker.launch_batch(worker.slots[0], [(bulk, 0, 6)], Lane.BULK)
    assert ring.free_bytes() == ring.capacity  # nothing held for the bulk batch
    worker.launch_batch(worker.slots[0], [(query, 0, 1)], Lane.INTERACTIVE)
    assert ring.free_bytes() < ring.capacity
    engine.pending[1].finished = True
    assert worker.collect()
    ((kind, (_, results)),) = read_all(ring)
    assert kind == records.BATCH_RESULT and [(r.req_id, r.status) for r in results] == [(2, records.OK)]
    assert np.frombuffer(results[0].body, "<f4").tolist() == [1.0] * HIDDEN  # the interactive lane's rows
    assert not worker.collect()  # the bulk batch is still running
    engine.pending[0].finished = True
    assert worker.collect()
    ((kind, (_, results)),) = read_all(ring)
    assert [(r.req_id, r.status) for r in results] == [(1, records.OK)]
    assert np.frombuffer(results[0].body, "<f4").reshape(6, HIDDEN).tolist() == [[2.0] * HIDDEN] * 6


def test_with_two_models_side_by_side_one_model_s_long_batch_never_holds_back_the_other_s_answer(worker):
    """Two models on a CUDA-like worker: no batch holds its record at launch, so an embedder's
    query launched after a reranker's long interactive batch is published as soon as it is done,
    while that batch still runs (a held record would keep it unpublished behind that one)."""
    from pollen.worker.model_slot import ModelSlot

    first, second = LaterEngine(), LaterEngine()
    worker.slots[0].engine = first
    worker.slots.append(ModelSlot(1, worker.slots[0].spec, second, 0))
    worker.side_by_side, worker.hold_records = True, False
    ring = worker.links[0].responses
    long_batch, query = make_job(1, [4] * 6), make_job(2, [3])
    worker.launch_batch(worker.slots[0], [(long_batch, 0, 6)], Lane.INTERACTIVE)
    worker.launch_batch(worker.slots[1], [(query, 0, 1)], Lane.INTERACTIVE)
    assert ring.free_bytes() == ring.capacity  # nothing held for either
    second.pending[0].finished = True
    assert worker.collect()
    ((kind, (_, results)),) = read_all(ring)
    assert [(r.req_id, r.status) for r in results] == [(2, records.OK)]
    assert not worker.collect()  # the first model's batch still runs
    first.pending[0].finished = True
    assert worker.collect()
    ((kind, (_, results)),) = read_all(ring)
    assert [(r.req_id, r.status) for r in results] == [(1, records.OK)]
