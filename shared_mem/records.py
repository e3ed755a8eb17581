"""The records that travel through the rings: fixed little-endian headers, then flat arrays.

Request ring (frontend -> worker), kind REQUEST:

    +--------+----------+-------------+--------+--------+-------+------+-------+----------+------+------+-------+
    | req_id | admit_ns | deadline_ns | n_seqs | n_rows | n_out | dims | flags | encoding | lane | task | model |
    | u64    | u64      | u64         | u32    | u32    | u32   | u32  | u32   | u32      | u32  | u32  | u32   |
    +--------+----------+-------------+--------+--------+-------+------+-------+----------+------+------+-------+
    | lengths: u32 * n_seqs                                                                              |
    | only when flags & FLAG_ROWS:  row_seq u32*n_rows | row_start u32*n_rows | row_stop u32*n_rows      |
    |                               row_out u32*n_rows | row_weight f32*n_rows                           |
    | ids: i32 * sum(lengths)                                                                            |
    +----------------------------------------------------------------------------------------------------+

    admit_ns and deadline_ns are CLOCK_MONOTONIC (system-wide on Linux), so the worker can report
    queue time and drop a request whose deadline passed before it reached the model; deadline_ns
    0 means none. flags bit 0: normalize; bit 1 (FLAG_ROWS): the row arrays follow. dims 0: the
    model's full size. lane and task: common/request.py's Lane and Task; model: which of the
    server's models answers it (its index in the --model list).

    Rows are what the model pools; outputs are what the answer holds. Without FLAG_ROWS every
    sequence is one row over all its tokens and one output (n_rows = n_out = n_seqs). With it,
    row i pools tokens [row_start, row_stop) of sequence row_seq (rows in sequence order), and
    output o is the row_weight-weighted mean of the rows whose row_out is o: contextual chunks
    are many rows of one sequence, a CHUNK_MEAN text is several sequences (windows) whose rows
    share one output.

Request ring, kind CANCEL: req_id u64. The client left: forget the request if it has not reached
the model yet (the worker answers it with status CANCELLED), else finish it as usual.

Response ring (worker -> frontend), kind RESULT:

    +---------+---------+------+------+----------+----------+--------------+-----------------------------+
    | req_id  | status  | rows | dims | encoding | queue_us | inference_us | body                        |
    | u64     | u32     | u32  | u32  | u32      | u64      | u64          |                             |
    +---------+---------+------+------+----------+----------+--------------+-----------------------------+

    status 0: the body is rows x dims values in `encoding`, and for ENCODING_INT8 then rows f32
    scales. Otherwise a google.rpc.Code (4 DEADLINE_EXCEEDED and 1 CANCELLED: dropped before the
    model; 13 INTERNAL: the model failed) and the body is a utf-8 message.

    The worker writes these for requests it drops before the model (deadline, cancel). They go
    after any batch records the worker holds open (shared_mem/ring.py), so they are published
    when those are committed, at most one batch later.

Response ring, kind BATCH_RESULT: one per batch the worker ran and frontend it ran requests of
(a batch mixes requests of every frontend; each gets its part, in its own response ring). The
worker reserves it when it launches the batch, sized for what the part will answer, and commits
it when the batch is done; the device copies the part's pooled rows straight into its raw area.

    +--------+------+------+-----------+--------+--------+--------------+-----+
    | tokens | seqs | rows | n_entries | hidden | raw_at | batch_tokens | pad |
    | u32    | u32  | u32  | u32       | u32    | u32    | u32          | u32 |
    +--------+------+------+-----------+--------+--------+--------------+-----+--------------+
    | entries, n_entries x 48 bytes, one per request whose answer this batch completes:        |
    |   req_id u64 | status u32 | rows u32 | dims u32 | encoding u32 | queue_us u64 |          |
    |   inference_us u64 | body_at u32 | body_len u32                                          |
    | error room: ERROR_ROOM bytes, the utf-8 message of a failed batch                         |
    | raw area at raw_at (8-aligned): rows x hidden f32, the batch's pooled rows in batch order |
    | answer areas (8-aligned) of the requests whose earlier rows came in earlier batches       |
    +------------------------------------------------------------------------------------------+

    tokens, seqs and rows count what this part ran; batch_tokens is the whole batch's tokens in
    the batch's first part, 0 in the others (so pollen_batch_tokens counts each batch once). An entry is
    a RESULT without its body: the body is the record's bytes [body_at, body_at + body_len).
    Where it points:
    - a request wholly in this batch, float32, full size, no row plan, not native int8: its
      slice of the raw area, which the device already normalized if asked. Nobody copies it.
    - any other request wholly in this batch (dims, another encoding, chunks, CHUNK_MEAN, native
      int8): its encoded answer, written by the worker's CPU over the start of its own raw slice
      (the answer is never larger than the rows it comes from).
    - a request that began in an earlier batch: its answer area, sized when the batch was launched.
    - status INTERNAL (the batch failed): the error room.
    Raw rows of requests in the last two cases are not normalized on the device: the cut comes
    first, and native int8 never normalizes.

Kind READY carries a utf-8 JSON object (the worker's pid and what it loaded): the first record a
worker writes on a frontend's response ring. (Stopping a worker is the supervisor's business, over
the control link: common/control.py.)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from pollen.common.request import LANES, RequestOptions, Task

REQUEST, RESULT, READY, CANCEL, BATCH_RESULT = 1, 2, 3, 4, 5

FLAG_NORMALIZE = 1
FLAG_ROWS = 2

# The statuses a RESULT (or a BATCH_RESULT entry) carries, google.rpc.Code numbers.
from pollen.common.status import CANCELLED, DEADLINE_EXCEEDED, INTERNAL, OK  # noqa: E402,F401

_REQUEST = struct.Struct("<QQQIIIIIIIII")
_RESULT = struct.Struct("<QIIIIQQ")
_CANCEL = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
_INT32_LE = np.dtype("<i4")
_BATCH = struct.Struct("<IIIIIIII")
REQUEST_HEADER = _REQUEST.size
RESULT_HEADER = _RESULT.size
ROW_BYTES = 20  # the five row arrays, per row
BATCH_HEADER = _BATCH.size
ENTRY = np.dtype([("req_id", "<u8"), ("status", "<u4"), ("rows", "<u4"), ("dims", "<u4"),
                  ("encoding", "<u4"), ("queue_us", "<u8"), ("inference_us", "<u8"), ("body_at", "<u4"),
                  ("body_len", "<u4")])
_ENTRY = struct.Struct("<QIIIIQQII")  # ENTRY's fields, for decode_batch_result
assert _ENTRY.size == ENTRY.itemsize
ERROR_ROOM = 1024  # bytes of a failed batch's message kept in its record (longer ones are cut)


@dataclass(slots=True)
class RowPlan:
    """Which token spans the model pools (rows) and how rows combine into outputs."""

    seq: np.ndarray     # u32 [n_rows], non-decreasing
    start: np.ndarray   # u32 [n_rows]
    stop: np.ndarray    # u32 [n_rows]
    out: np.ndarray     # u32 [n_rows], the output each row feeds
    weight: np.ndarray  # f32 [n_rows]

    @property
    def n_out(self) -> int:
        return int(self.out.max()) + 1 if len(self.out) else 0


def encode_request(req_id: int, admit_ns: int, seqs: list[np.ndarray], options: RequestOptions,
                   rows: RowPlan | None = None) -> bytes:
    """One request record's payload, built once and kept by the frontend for a resend."""
    flags = FLAG_NORMALIZE if options.normalize else 0
    if rows is None and len(seqs) == 1 and seqs[0].dtype == _INT32_LE:
        # A query: one sequence, one output, packed with struct alone (numpy's per-call setup
        # dominates at this size, and this runs once per query).
        (seq,) = seqs
        head = _REQUEST.pack(req_id, admit_ns, options.deadline_ns, 1, 1, 1, options.dims, flags, options.encoding,
                             options.lane, options.task, options.model)
        return b"".join((head, _LENGTH.pack(len(seq)), seq.tobytes()))
    lengths = np.fromiter((len(s) for s in seqs), dtype="<u4", count=len(seqs))
    ids = np.concatenate(seqs).astype("<i4", copy=False) if seqs else np.empty(0, "<i4")
    parts = [lengths.tobytes()]
    n_rows = n_out = len(seqs)
    if rows is not None:
        flags |= FLAG_ROWS
        n_rows, n_out = len(rows.seq), rows.n_out
        parts += [np.asarray(a, dtype=t).tobytes() for a, t in
                  ((rows.seq, "<u4"), (rows.start, "<u4"), (rows.stop, "<u4"), (rows.out, "<u4"),
                   (rows.weight, "<f4"))]
    head = _REQUEST.pack(req_id, admit_ns, options.deadline_ns, len(seqs), n_rows, n_out, options.dims, flags,
                         options.encoding, options.lane, options.task, options.model)
    return b"".join((head, *parts, ids.tobytes()))


@dataclass(slots=True)
class RequestRecord:
    req_id: int
    admit_ns: int
    options: RequestOptions
    lengths: np.ndarray  # u32 [n_seqs]
    ids: np.ndarray      # i32 [sum(lengths)], a private copy: the ring's bytes are released after parsing
    n_out: int = 0
    rows: RowPlan | None = None  # None: one row (and one output) per sequence


def decode_request(view: memoryview) -> RequestRecord:
    (req_id, admit_ns, deadline_ns, n, n_rows, n_out, dims, flags, encoding, lane,
     task, model) = _REQUEST.unpack_from(view, 0)
    offset = REQUEST_HEADER
    lengths = np.frombuffer(view, dtype="<u4", count=n, offset=offset).copy()
    offset += 4 * n
    rows = None
    if flags & FLAG_ROWS:
        arrays = []
        for t in ("<u4", "<u4", "<u4", "<u4", "<f4"):
            arrays.append(np.frombuffer(view, dtype=t, count=n_rows, offset=offset).copy())
            offset += 4 * n_rows
        rows = RowPlan(*arrays)
    ids = np.frombuffer(view, dtype="<i4", count=int(lengths.sum()), offset=offset).copy()
    options = RequestOptions(Task(task), dims, bool(flags & FLAG_NORMALIZE), encoding, LANES[lane], deadline_ns,
                             model)
    return RequestRecord(req_id, admit_ns, options, lengths, ids, n_out, rows)


def encode_cancel(req_id: int) -> bytes:
    return _CANCEL.pack(req_id)


def decode_cancel(view: memoryview) -> int:
    return _CANCEL.unpack_from(view, 0)[0]


def result_header(req_id: int, status: int, rows: int, dims: int, encoding: int, queue_us: int,
                  inference_us: int) -> bytes:
    """A RESULT record's header; its body follows."""
    return _RESULT.pack(req_id, status, rows, dims, encoding, queue_us, inference_us)


@dataclass(slots=True)
class ResultRecord:
    req_id: int
    status: int
    rows: int
    dims: int
    encoding: int
    queue_us: int
    inference_us: int
    body: bytes  # embeddings (then int8 scales), or the error message


def decode_result(view: memoryview) -> ResultRecord:
    head = _RESULT.unpack_from(view, 0)
    # One copy out of shared memory: protobuf's bytes field needs bytes it owns.
    return ResultRecord(*head, bytes(view[RESULT_HEADER:]))


def align8(n: int) -> int:
    return (n + 7) & ~7


def raw_at(n_entries: int) -> int:
    """Offset of the raw area in a BATCH_RESULT record with `n_entries` entries."""
    return align8(BATCH_HEADER + n_entries * ENTRY.itemsize + ERROR_ROOM)


def max_batch_rows(max_record: int, hidden: int) -> int:
    """Most rows one batch may count so that its BATCH_RESULT record fits `max_record`. A row costs
    its raw f32 values and at most one entry (a request answered here has a row here). Answers of
    requests wholly in the batch fit over their own raw rows; a request that began in an earlier
    batch needs an answer area, at most 4 x hidden + 4 bytes an output (float32, or int8 and its
    scale), so the batcher counts its outputs as rows too (worker/batcher.py, Job.record_rows)."""
    return max(0, (max_record - raw_at(0)) // (4 * hidden + ENTRY.itemsize))


def pack_batch_header(buf: memoryview, tokens: int, seqs: int, rows: int, n_entries: int, hidden: int,
                      batch_tokens: int) -> None:
    _BATCH.pack_into(buf, 0, tokens, seqs, rows, n_entries, hidden, raw_at(n_entries), batch_tokens, 0)


def batch_entries(buf: memoryview, n_entries: int) -> np.ndarray:
    """The entries of a BATCH_RESULT record as a writable structured view (see ENTRY)."""
    return np.frombuffer(buf, dtype=ENTRY, count=n_entries, offset=BATCH_HEADER)


@dataclass(slots=True)
class BatchReport:
    tokens: int
    seqs: int
    rows: int
    batch_tokens: int = 0  # the whole batch's tokens in its first part; 0 in the others


def decode_batch_result(view: memoryview) -> tuple[BatchReport, list[ResultRecord]]:
    """The batch's figures and one ResultRecord per entry, bodies copied out of the ring. The
    entries are read with struct rather than as batch_entries' numpy view: a frontend decodes one
    of these per batch, often of one entry, where numpy's per-call setup is the larger cost."""
    tokens, seqs, rows, n, _, _, batch_tokens, _ = _BATCH.unpack_from(view, 0)
    results = [ResultRecord(req_id, status, n_rows, dims, encoding, queue_us, inference_us,
                            bytes(view[at:at + length]))
               for req_id, status, n_rows, dims, encoding, queue_us, inference_us, at, length
               in _ENTRY.iter_unpack(view[BATCH_HEADER:BATCH_HEADER + n * _ENTRY.size])]
    return BatchReport(tokens, seqs, rows, batch_tokens), results
