"""Property-based fuzzing, seeded (derandomize=True: the same examples every run) and bounded to
seconds: the ring record codec, the frontend's request admission with the real tokenizer, and the
HTTP door's JSON mapping. Each may refuse its input, only in the one documented way."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pollen.common.errors import RequestError
from pollen.common.model_spec import default_model_path, read_model_spec
from pollen.common.request import Lane, RequestOptions, Task
from pollen.server.http_api.door import Rejected, to_embed_request
from pollen.server.pipeline.admission import Admission
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.shared_mem import records
from pollen.v1 import embedder_pb2 as pb

FUZZ = settings(derandomize=True, max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)


# --- the ring's records (shared_mem/records.py) ---

@st.composite
def row_plans(draw, lengths: list[int]) -> records.RowPlan | None:
    if not lengths or not draw(st.booleans()):
        return None
    n = draw(st.integers(1, 12))
    seq = sorted(draw(st.lists(st.integers(0, len(lengths) - 1), min_size=n, max_size=n)))
    start = [draw(st.integers(0, lengths[s])) for s in seq]
    stop = [draw(st.integers(a, lengths[s])) for a, s in zip(start, seq)]
    out = draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
    weight = draw(st.lists(st.floats(0, 1e6, width=32), min_size=n, max_size=n))
    return records.RowPlan(*(np.array(a, t) for a, t in ((seq, np.uint32), (start, np.uint32), (stop, np.uint32),
                                                         (out, np.uint32), (weight, np.float32))))


@FUZZ
@given(data=st.data(), req_id=U64, admit_ns=U64, deadline_ns=U64, dims=U32, normalize=st.booleans(),
       encoding=U32, priority=st.sampled_from(Lane), task=st.sampled_from(Task),
       seqs=st.lists(st.lists(st.integers(-2**31, 2**31 - 1), max_size=40), max_size=10))
def test_request_records_round_trip(data, req_id, admit_ns, deadline_ns, dims, normalize, encoding, priority, task,
                                    seqs):
    arrays = [np.array(s, np.int32) for s in seqs]
    rows = data.draw(row_plans([len(s) for s in seqs]))
    options = RequestOptions(task, dims, normalize, encoding, priority, deadline_ns)
    got = records.decode_request(memoryview(records.encode_request(req_id, admit_ns, arrays, options, rows)))
    assert (got.req_id, got.admit_ns, got.options) == (req_id, admit_ns, options)
    assert got.lengths.tolist() == [len(s) for s in seqs]
    assert got.ids.tolist() == [i for s in seqs for i in s]
    if rows is None:
        assert got.rows is None and got.n_out == len(seqs)
    else:
        for name in ("seq", "start", "stop", "out", "weight"):
            np.testing.assert_array_equal(getattr(got.rows, name), getattr(rows, name))
        assert got.n_out == rows.n_out


@FUZZ
@given(req_id=U64, admit_ns=U64, deadline_ns=U64, dims=U32, normalize=st.booleans(), encoding=U32,
       priority=st.sampled_from(Lane), ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=40))
def test_a_query_s_record_is_the_general_record(req_id, admit_ns, deadline_ns, dims, normalize, encoding, priority, ids):
    """One int32 sequence takes encode_request's struct-only shortcut; an int64 one the general path."""
    def encode(dtype):
        options = RequestOptions(Task.EMBED, dims, normalize, encoding, priority, deadline_ns)
        return records.encode_request(req_id, admit_ns, [np.array(ids, dtype)], options)
    assert encode(np.int32) == encode(np.int64)


@FUZZ
@given(head=st.tuples(U64, U32, U32, U32, U32, U64, U64), body=st.binary(max_size=200))
def test_result_records_decode(head, body):
    got = records.decode_result(memoryview(records.result_header(*head) + body))
    assert (got.req_id, got.status, got.rows, got.dims, got.encoding, got.queue_us, got.inference_us) == head
    assert got.body == body


@FUZZ
@given(data=st.data(), figures=st.tuples(U32, U32, U32), hidden=st.integers(1, 64),
       entries=st.lists(st.tuples(U64, U32, U32, U32, U32, U64, U64, st.binary(max_size=64)), max_size=8))
def test_batch_result_records_decode(data, figures, hidden, entries):
    at = records.raw_at(len(entries))
    buf = bytearray(at + sum(len(e[-1]) for e in entries))
    records.pack_batch_header(memoryview(buf), *figures, len(entries), hidden, figures[0])
    table = records.batch_entries(memoryview(buf), len(entries))
    for i, (*fields, body) in enumerate(entries):
        table[i] = (*fields, at, len(body))
        buf[at:at + len(body)] = body
        at += len(body)
    report, results = records.decode_batch_result(memoryview(bytes(buf)))
    assert (report.tokens, report.seqs, report.rows, report.batch_tokens) == (*figures, figures[0])
    assert [(r.req_id, r.status, r.rows, r.dims, r.encoding, r.queue_us, r.inference_us, r.body) for r in results] \
        == [tuple(e) for e in entries]


# --- the frontend's request admission (server/pipeline/admission.py), with the real tokenizer ---

FIELDS = ("texts", "token_ids", "chunks", "encoding", "truncate", "long_input", "priority", "dimensions",
          "max_tokens", "prompt", "prompt_name", "inputs in one request")
MAX_TEXTS = 16
TEXT = st.lists(st.sampled_from(list("ab .,東\u0301\x00") + ["word", "🙂", "x" * 120]), max_size=40).map("".join)


@pytest.fixture(scope="module")
def admission():
    model = default_model_path()
    spec = dataclasses.replace(read_model_spec(model), prompts=(("query", "query: "), ("long", "p " * 300)))
    pool = ThreadPoolExecutor(1)
    loop = asyncio.new_event_loop()
    yield Admission(spec, TextTokenizer(model, spec.max_tokens), pool, MAX_TEXTS), loop
    loop.close()
    pool.shutdown()


def mostly(valid: list[int], invalid: list[int]) -> st.SearchStrategy[int]:
    """A valid enum value four times in five, else an unknown one."""
    return st.sampled_from(valid * 4 + invalid)


@st.composite
def requests(draw) -> pb.EmbedRequest:
    """Requests near the valid ones: one kind of input (sometimes two), options mostly known."""
    kinds = draw(st.sampled_from([{"texts"}] * 4 + [{"token_ids"}] * 2 + [{"chunks"}] * 2 +
                                 [set(), {"texts", "chunks"}, {"token_ids", "texts"}]))
    ids = st.lists(st.integers(100, 30_000) | st.integers(-5, 31_000), max_size=300)
    return pb.EmbedRequest(
        texts=draw(st.lists(TEXT, min_size=1, max_size=MAX_TEXTS + 2)) if "texts" in kinds else [],
        token_ids=[pb.TokenIds(ids=i) for i in draw(st.lists(ids, min_size=1, max_size=3))]
        if "token_ids" in kinds else [],
        chunks=draw(st.lists(TEXT, min_size=1, max_size=3)) if "chunks" in kinds else [],
        dimensions=draw(st.sampled_from([0] * 12 + [1, 31, 32, 100, 384, 385, 2**32 - 1])),
        normalize=draw(st.booleans()), encoding=draw(mostly(list(pb.Encoding.values()), [-1, 99])),
        truncate=draw(mostly([0, 1, 2], [3, -1])), long_input=draw(mostly([0, 1], [2])),
        priority=draw(mostly([0, 1], [7])), max_tokens=draw(st.sampled_from([0, 0, 1, 2, 3, 8, 256, 257, 2**32 - 1])),
        prompt_name=draw(st.sampled_from(["", "", "", "query", "long", "nope"])),
        prompt=draw(st.sampled_from(["", "", "", "q: ", "東", "p" * 4097]) | TEXT))


@settings(FUZZ, max_examples=400)
@given(request=requests())
def test_admission_admits_or_names_the_field(admission, request):
    admit, loop = admission
    try:
        job = loop.run_until_complete(admit.admit(request))
    except RequestError as exc:
        assert exc.code.name == "INVALID_ARGUMENT", exc.message
        assert re.search("|".join(FIELDS), exc.message), exc.message
        event("refused: " + re.sub(r"\d+", "N", exc.message)[:40])  # --hypothesis-show-statistics: shares
        return
    event("admitted")
    limit = request.max_tokens or 256
    assert job.seqs and all(s.dtype == np.int32 and 0 < len(s) <= limit for s in job.seqs)
    assert all(int(s.min()) >= 0 and int(s.max()) < admit.spec.vocab_size for s in job.seqs)
    outputs = job.rows.n_out if job.rows is not None else len(job.seqs)
    assert outputs == len(request.texts) + len(request.token_ids) + len(request.chunks)


# --- the HTTP door's JSON mapping (server/http_api/door.py) ---

NAMES = ["input", "model", "dimensions", "encoding_format", "user", "encoding", "normalize", "truncate",
         "max_tokens", "prompt_name", "prompt", "long_input", "chunks", "priority", "timeout_ms"]
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) |
    st.sampled_from(["float", "base64", "int8", "end", "chunk_mean", "bulk", "", "x"]) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=8),
                                                                  inner, max_size=6),
    max_leaves=20)
VALID = {"input": st.one_of(TEXT.filter(bool), st.lists(TEXT, max_size=4),
                           st.lists(st.integers(0, 30_000), max_size=9),
                           st.lists(st.lists(st.integers(-1, 2**32), max_size=5), max_size=3)),
         "encoding_format": st.sampled_from(["float", "base64"]),
         "encoding": st.sampled_from(["float32", "int8", "ubinary"]),
         "normalize": st.booleans(), "truncate": st.sampled_from(["none", "end", "start"]),
         "dimensions": st.integers(1, 400), "max_tokens": st.integers(0, 300), "prompt": TEXT,
         "long_input": st.sampled_from(["truncate", "chunk_mean"]),
         "priority": st.sampled_from(["interactive", "bulk"]),
         "chunks": st.lists(TEXT, max_size=3), "timeout_ms": st.integers(0, 10**6), "model": st.text(max_size=8)}


@st.composite
def near_valid_bodies(draw) -> bytes:
    """A body of known fields with well-typed values, and sometimes one field of any JSON value."""
    options = sorted(set(VALID) - {"input", "chunks"})
    body = {name: draw(VALID[name]) for name in draw(st.sets(st.sampled_from(options), max_size=4))}
    what = draw(st.sampled_from(["input"] * 4 + ["chunks"]))
    body[what] = draw(VALID[what])
    if draw(st.integers(0, 3)) == 0:
        body[draw(st.sampled_from(NAMES) | st.text(max_size=8))] = draw(JSONISH)
    return json.dumps(body).encode()


BODIES = st.one_of(near_valid_bodies(), near_valid_bodies(), JSONISH.map(lambda v: json.dumps(v).encode()),
                   st.binary(max_size=60))


@FUZZ
@given(body=BODIES)
def test_http_door_maps_or_rejects(body):
    # to_embed_request reads only the body of the parsed HTTP request.
    try:
        message, encoding_format = to_embed_request(SimpleNamespace(body=body))
    except Rejected as exc:
        assert exc.message
        event("rejected: " + re.sub(r"\d+", "N", exc.message)[:50])
        return
    event("mapped")
    assert isinstance(message, pb.EmbedRequest) and encoding_format in ("float", "base64")
    assert len(message.texts) + len(message.token_ids) + len(message.chunks) > 0
