"""The one place where pooled rows are combined, cut (Matryoshka), normalized and encoded.

Encoded rows are written straight into the caller's buffer (a slice of the response ring), so
the embeddings leave the worker with no copy beyond this one.

int8 comes in two kinds (docs/design/requests.md, "Encodings"):
- a model whose own output is int8 (pplx-embed, `spec.native_int8`): q = round(127 * tanh(x)),
  x being the pooled vector cut to `dims` and never normalized (tanh of a unit vector would throw
  the model's scale away; the model's int8 vectors are compared by cosine anyway). The scale
  answered is 1/127, so q * scale approximates tanh(x).
- any other model: a symmetric per-vector scale, scale = max|x| / 127 and q = round(x / scale),
  x being the cut (and, if asked, normalized) vector; q * scale approximates x. A zero vector
  gets scale 0 and q = 0.
The body is laid out as pollen/common/encodings.py draws it.
"""
from __future__ import annotations

import numpy as np

from pollen.common.encodings import to_bfloat16_bits
from pollen.v1 import embedder_pb2 as pb


def combine(pooled: np.ndarray, out_index: np.ndarray, weights: np.ndarray, n_out: int) -> np.ndarray:
    """Weighted mean of the pooled rows that share an output (CHUNK_MEAN windows of one text)."""
    # One segment sum per output over the rows sorted by output: np.add.at's per-element scatter
    # is far slower on answers of many rows.
    order = np.argsort(out_index, kind="stable")
    index = out_index[order]
    starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
    sums = np.zeros((n_out, pooled.shape[1]), dtype=np.float64)
    sums[index[starts]] = np.add.reduceat(pooled[order] * weights[order, None], starts, axis=0)
    totals = np.bincount(out_index, weights=weights, minlength=n_out)
    return (sums / totals[:, None]).astype(np.float32)


def normalize_rows(rows: np.ndarray, flags: np.ndarray | None = None) -> np.ndarray:
    """rows [R, H] L2-normalized, x / max(|x|, 1e-12) (a zero row stays zero rather than becoming
    NaN); with `flags` [R], only the rows whose flag is non-zero. The device's normalization
    (worker/models/pooling.py, normalize_rows) rounds as this does."""
    norms = np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), np.float32(1e-12))
    if flags is None:
        return rows / norms
    return np.where(np.asarray(flags)[:, None] != 0, rows / norms, rows)


def finish(pooled: np.ndarray, dims: int, normalize: bool, encoding: int, out: memoryview,
           native_int8: bool = False) -> None:
    """Cut pooled [rows, hidden] float32 to its first `dims` values, normalize, encode into `out`."""
    x = pooled[:, :dims] if dims else pooled
    if encoding == pb.ENCODING_INT8 and native_int8:
        write_int8(np.round(127 * np.tanh(x.astype(np.float64))), np.full(len(x), 1 / 127), out)
        return
    if normalize:
        x = normalize_rows(x)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if encoding == pb.ENCODING_FLOAT32:
        np.copyto(np.frombuffer(out, dtype="<f4").reshape(x.shape), x)
    elif encoding == pb.ENCODING_FLOAT16:
        np.copyto(np.frombuffer(out, dtype="<f2").reshape(x.shape), x, casting="same_kind")
    elif encoding == pb.ENCODING_BFLOAT16:
        np.copyto(np.frombuffer(out, dtype="<u2").reshape(x.shape), to_bfloat16_bits(x))
    elif encoding == pb.ENCODING_INT8:
        scale = np.abs(x).max(axis=1, initial=0).astype(np.float64) / 127
        q = np.round(x / np.where(scale > 0, scale, 1)[:, None])
        write_int8(q, scale, out)
    elif encoding == pb.ENCODING_UBINARY:
        packed = np.packbits(x > 0, axis=1, bitorder="little")
        np.copyto(np.frombuffer(out, dtype=np.uint8).reshape(packed.shape), packed)
    else:
        raise ValueError(f"encoding {encoding} is not computed by this build")


def write_int8(q: np.ndarray, scales: np.ndarray, out: memoryview) -> None:
    n = q.size
    np.copyto(np.frombuffer(out, dtype=np.int8, count=n).reshape(q.shape), np.clip(q, -127, 127), casting="unsafe")
    np.copyto(np.frombuffer(out, dtype="<f4", count=len(scales), offset=n), scales, casting="same_kind")

