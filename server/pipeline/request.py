"""The frontend's one request type, from admission to the answer: admission makes a `Request`
(token-id sequences, their row plan, the resolved RequestOptions), the router encodes its record
(shared_mem/records.py), a worker's channel holds it until the answer arrives or it is dropped.

A request too big for one record travels as several requests, its *parts*: a record must fit the
request ring's max_record (half the ring, shared_mem/ring.py), and rather than size every ring for
the largest request the settings allow, a large request is cut between its outputs into parts
that each fit, and the parts' answers are joined in order. The unit that is never cut is an
output with all its sequences: a text, a CHUNK_MEAN text with its windows, a contextual-chunk
document with all its chunks. A unit larger than one record is refused (INVALID_ARGUMENT, "split
it").
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from pollen.common import encodings
from pollen.common.request import RequestOptions
from pollen.server.pipeline.outputs import Outputs
from pollen.shared_mem import records
from pollen.v1 import embedder_pb2 as pb


@dataclass(slots=True, eq=False)
class Request:
    seqs: list[np.ndarray]
    options: RequestOptions
    rows: records.RowPlan | None = None  # None: one output per sequence
    tokens: int = 0
    # An embedding request's `outputs`, as admission checked them (server/pipeline/outputs.py): what the
    # service makes of the answer's rows. None: plain rows (rerank and classify requests, parts).
    wanted: Outputs | None = None
    # Set by the router and the channel once it is sent.
    req_id: int = 0
    record: bytes = b""   # the request record, kept for a resend
    future: asyncio.Future | None = None
    attempts: int = 0     # deaths of a worker that held it
    ring_end: int = 0     # the request ring's write position after its record: held once read past
    sent: bool = False    # in the ring (or the worker) rather than the backlog
    drop_reason: str = ""  # set when the frontend asked the worker to forget it

    def outputs(self) -> int:
        """The rows the answer holds (a RowPlan's rows: at least its outputs)."""
        return len(self.seqs) if self.rows is None else len(self.rows.seq)

    def parts(self, max_record: int, max_rows: int = 0) -> list[Request]:
        """This request as parts of at most max_record bytes and (from the second unit of a part
        on) max_rows rows each (0: any), in output order; ValueError for a unit too large for one
        record."""
        seqs, rows = self.seqs, self.rows
        parts, start = [], None
        for s0, s1, r0, r1 in units(seqs, rows):
            size = record_bytes(seqs[s0:s1], r1 - r0 if rows is not None else 0)
            if size > max_record:
                raise ValueError(f"one input holds {sum(len(s) for s in seqs[s0:s1])} tokens, more than one "
                                 f"request record can carry ({max_record} bytes)")
            if start is None:
                start = (s0, r0)
            elif (record_bytes(seqs[start[0]:s1], r1 - start[1] if rows is not None else 0) > max_record
                  or (max_rows and r1 - start[1] > max_rows)):
                parts.append(self.part(start, (s0, r0)))
                start = (s0, r0)
        parts.append(self.part(start, (len(seqs), len(rows.seq) if rows is not None else len(seqs))))
        return parts

    def part(self, start: tuple[int, int], end: tuple[int, int]) -> Request:
        (s0, r0), (s1, r1) = start, end
        seqs, rows = self.seqs[s0:s1], self.rows
        tokens = sum(len(s) for s in seqs)
        if rows is None:
            return Request(seqs, self.options, None, tokens)
        out = rows.out[r0:r1]
        return Request(seqs, self.options, records.RowPlan(rows.seq[r0:r1] - s0, rows.start[r0:r1],
                                                           rows.stop[r0:r1], out - out.min(), rows.weight[r0:r1]),
                       tokens)


def record_bytes(seqs: list[np.ndarray], n_rows: int) -> int:
    return records.REQUEST_HEADER + 4 * len(seqs) + records.ROW_BYTES * n_rows + 4 * sum(len(s) for s in seqs)


def units(seqs: list[np.ndarray], rows: records.RowPlan | None) -> list[tuple[int, int, int, int]]:
    """The uncuttable units as (first sequence, end sequence, first row, end row), in order."""
    if rows is None:
        return [(i, i + 1, i, i + 1) for i in range(len(seqs))]
    # A cut may go before row i when it starts a new sequence and every output before it is done:
    # the largest output so far is below the smallest one from i on.
    seq, out = rows.seq.astype(np.int64), rows.out.astype(np.int64)
    below = np.maximum.accumulate(out)[:-1] < np.minimum.accumulate(out[::-1])[::-1][1:]
    cuts = np.flatnonzero((seq[1:] != seq[:-1]) & below) + 1
    bounds = [0, *cuts.tolist(), len(seq)]
    return [(int(seq[a]), int(seq[b - 1]) + 1, a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def join(results: list[records.ResultRecord]) -> records.ResultRecord:
    """The parts' answers (all OK, in order) as one: rows stacked, int8 scales after all values."""
    first = results[0]
    if len(results) == 1:
        return first
    if first.encoding == pb.ENCODING_INT8:
        pieces = [encodings.split_int8(r.body, r.rows, r.dims) for r in results]
        body = b"".join(values for values, _ in pieces) + b"".join(scales.tobytes() for _, scales in pieces)
    else:
        body = b"".join(r.body for r in results)
    return records.ResultRecord(first.req_id, records.OK, sum(r.rows for r in results), first.dims, first.encoding,
                                max(r.queue_us for r in results), max(r.inference_us for r in results), body)
