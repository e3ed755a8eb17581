"""The one place where pooled vectors are cut (Matryoshka), normalized and encoded.

Encoded rows are written straight into the caller's buffer (a slice of the response ring), so
the embeddings leave the worker with no copy beyond this one.
"""
from __future__ import annotations

import numpy as np

from pollen.v1 import embedder_pb2 as pb

# Encodings this build computes. INT8 needs a per-vector scale in the answer: it comes with the
# API issue, and until then the frontend answers UNIMPLEMENTED for it.
SUPPORTED = (pb.ENCODING_FLOAT32, pb.ENCODING_FLOAT16, pb.ENCODING_BFLOAT16, pb.ENCODING_UBINARY)


def row_bytes(dims: int, encoding: int) -> int:
    if encoding == pb.ENCODING_FLOAT32:
        return 4 * dims
    if encoding in (pb.ENCODING_FLOAT16, pb.ENCODING_BFLOAT16):
        return 2 * dims
    if encoding == pb.ENCODING_INT8:
        return dims
    if encoding == pb.ENCODING_UBINARY:
        return (dims + 7) // 8
    raise ValueError(f"unknown encoding {encoding}")


def finish(pooled: np.ndarray, dims: int, normalize: bool, encoding: int, out: memoryview) -> None:
    """Cut pooled [rows, hidden] float32 to its first `dims` values, normalize, encode into `out`."""
    x = pooled[:, :dims] if dims else pooled
    if normalize:
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        # A zero vector stays zero rather than becoming NaN.
        x = x / np.maximum(norms, np.float32(1e-12))
    x = np.ascontiguousarray(x, dtype=np.float32)
    if encoding == pb.ENCODING_FLOAT32:
        np.copyto(np.frombuffer(out, dtype="<f4").reshape(x.shape), x)
    elif encoding == pb.ENCODING_FLOAT16:
        np.copyto(np.frombuffer(out, dtype="<f2").reshape(x.shape), x, casting="same_kind")
    elif encoding == pb.ENCODING_BFLOAT16:
        np.copyto(np.frombuffer(out, dtype="<u2").reshape(x.shape), to_bfloat16_bits(x))
    elif encoding == pb.ENCODING_UBINARY:
        packed = np.packbits(x > 0, axis=1, bitorder="little")
        np.copyto(np.frombuffer(out, dtype=np.uint8).reshape(packed.shape), packed)
    else:
        raise ValueError(f"encoding {encoding} is not computed by this build")


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (as torch does)."""
    bits = x.view(np.uint32)
    rounded = bits + (((bits >> 16) & 1) + 0x7FFF)
    out = (rounded >> 16).astype(np.uint16)
    # Keep NaNs NaN (rounding could carry a NaN's payload into the infinity pattern).
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)
