"""The records that travel through the rings: fixed little-endian headers, then flat arrays.

Request ring (frontend -> worker), kind EMBED:

    +---------+---------+---------+--------+----------+--------------+----------------------+------------------+
    | req_id  | admit_ns| n_seqs  | dims   | flags    | encoding     | lengths: u32*n_seqs  | ids: i32*sum(len)|
    | u64     | u64     | u32     | u32    | u32      | u32          |                      |                  |
    +---------+---------+---------+--------+----------+--------------+----------------------+------------------+

    admit_ns is CLOCK_MONOTONIC (system-wide on Linux), so the worker can report queue time.
    flags bit 0: normalize. dims 0: the model's full size.

Response ring (worker -> frontend), kind RESULT:

    +---------+---------+------+------+----------+----------+--------------+-----------------------------+
    | req_id  | status  | rows | dims | encoding | queue_us | inference_us | embeddings, or a utf-8 error|
    | u64     | u32     | u32  | u32  | u32      | u64      | u64          | message when status != 0    |
    +---------+---------+------+------+----------+----------+--------------+-----------------------------+

Kind READY carries a utf-8 JSON object (the worker's pid and what it loaded); kind STOP (request
ring) asks the worker to finish what it holds and exit.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

EMBED, STOP, RESULT, READY = 1, 2, 3, 4

FLAG_NORMALIZE = 1

_REQUEST = struct.Struct("<QQIIII")
_RESULT = struct.Struct("<QIIIIQQ")
REQUEST_HEADER = _REQUEST.size
RESULT_HEADER = _RESULT.size


def encode_request(req_id: int, admit_ns: int, seqs: list[np.ndarray], dims: int, normalize: bool,
                   encoding: int) -> bytes:
    """One request record's payload, built once and kept by the frontend for a resend."""
    lengths = np.fromiter((len(s) for s in seqs), dtype="<u4", count=len(seqs))
    ids = np.concatenate(seqs).astype("<i4", copy=False) if seqs else np.empty(0, "<i4")
    head = _REQUEST.pack(req_id, admit_ns, len(seqs), dims, FLAG_NORMALIZE if normalize else 0, encoding)
    return b"".join((head, lengths.tobytes(), ids.tobytes()))


@dataclass(slots=True)
class RequestRecord:
    req_id: int
    admit_ns: int
    dims: int
    normalize: bool
    encoding: int
    lengths: np.ndarray  # u32 [n_seqs]
    ids: np.ndarray      # i32 [sum(lengths)], a private copy: the ring's bytes are released after parsing


def decode_request(view: memoryview) -> RequestRecord:
    req_id, admit_ns, n, dims, flags, encoding = _REQUEST.unpack_from(view, 0)
    lengths = np.frombuffer(view, dtype="<u4", count=n, offset=REQUEST_HEADER).copy()
    ids = np.frombuffer(view, dtype="<i4", count=int(lengths.sum()), offset=REQUEST_HEADER + 4 * n).copy()
    return RequestRecord(req_id, admit_ns, dims, bool(flags & FLAG_NORMALIZE), encoding, lengths, ids)


def pack_result_header(buf: memoryview, req_id: int, status: int, rows: int, dims: int, encoding: int,
                       queue_us: int, inference_us: int) -> None:
    _RESULT.pack_into(buf, 0, req_id, status, rows, dims, encoding, queue_us, inference_us)


@dataclass(slots=True)
class ResultRecord:
    req_id: int
    status: int
    rows: int
    dims: int
    encoding: int
    queue_us: int
    inference_us: int
    body: bytes  # embeddings, or the error message


def decode_result(view: memoryview) -> ResultRecord:
    head = _RESULT.unpack_from(view, 0)
    # One copy out of shared memory: protobuf's bytes field needs bytes it owns.
    return ResultRecord(*head, bytes(view[RESULT_HEADER:]))
