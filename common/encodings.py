"""The answer encodings, defined once for the worker, the frontend's two doors and the client.

An answer's body is rows x dims values, little-endian, row-major:

    encoding   name        one value                          bytes a row
    FLOAT32    "float32"   IEEE float32                       4 * dims
    FLOAT16    "float16"   IEEE float16                       2 * dims
    BFLOAT16   "bfloat16"  the upper 16 bits of a float32,    2 * dims
                           rounded to nearest even
    INT8       "int8"      int8, times its row's scale        dims, then (after all rows)
                                                              one float32 scale a row
    UBINARY    "ubinary"   one bit (value > 0), packed        ceil(dims / 8)
                           least-significant bit first

In the ring the int8 scales follow the values in the same body; `split_int8` parts them, and
the gRPC answer carries them in `EmbedResponse.scales`.
"""
from __future__ import annotations

import numpy as np

from pollen.v1 import embedder_pb2 as pb

# Lower-case names (HTTP, the command line, the client's keyword arguments) to proto values.
BY_NAME = {"float32": pb.ENCODING_FLOAT32, "float16": pb.ENCODING_FLOAT16, "bfloat16": pb.ENCODING_BFLOAT16,
           "int8": pb.ENCODING_INT8, "ubinary": pb.ENCODING_UBINARY}
NAMES = tuple(BY_NAME)
# Every encoding this build computes, in proto values (Info lists them).
SUPPORTED = tuple(BY_NAME.values())

# How each encoding's bytes read as numpy values (bfloat16: its uint16 bit patterns).
DTYPES = {pb.ENCODING_FLOAT32: np.dtype("<f4"), pb.ENCODING_FLOAT16: np.dtype("<f2"),
          pb.ENCODING_BFLOAT16: np.dtype("<u2"), pb.ENCODING_INT8: np.dtype("i1"),
          pb.ENCODING_UBINARY: np.dtype("u1")}


def row_bytes(dims: int, encoding: int) -> int:
    """Bytes one answer row takes in the ring (int8: its values and its scale)."""
    if encoding == pb.ENCODING_FLOAT32:
        return 4 * dims
    if encoding in (pb.ENCODING_FLOAT16, pb.ENCODING_BFLOAT16):
        return 2 * dims
    if encoding == pb.ENCODING_INT8:
        return dims + 4
    if encoding == pb.ENCODING_UBINARY:
        return (dims + 7) // 8
    raise ValueError(f"unknown encoding {encoding}")


def row_width(dims: int, encoding: int) -> int:
    """Values a row holds in its numpy form (ubinary: packed bytes)."""
    return (dims + 7) // 8 if encoding == pb.ENCODING_UBINARY else dims


def split_int8(body: bytes, rows: int, dims: int) -> tuple[bytes, np.ndarray]:
    """An int8 body as it travels in the ring: (rows x dims values, float32 scales [rows])."""
    split = rows * dims
    return body[:split], np.frombuffer(body, "<f4", count=rows, offset=split)


def rows_of(body: bytes, rows: int, dims: int, encoding: int) -> np.ndarray:
    """A body (without int8 scales) as a read-only [rows, width] array of its raw values."""
    return np.frombuffer(body, dtype=DTYPES[encoding]).reshape(rows, row_width(dims, encoding))


def ragged(block: bytes, dtype, counts, width: int = 0) -> list[np.ndarray]:
    """A block of sum(counts) entries (rows of `width` values; 0: single values), little-endian,
    cut into one read-only array per text: token vectors (token_counts), sparse ids and weights
    (sparse_counts)."""
    values = np.frombuffer(block, np.dtype(dtype).newbyteorder("<"))
    if width:
        values = values.reshape(-1, width)
    return np.split(values, np.cumsum(counts)[:-1])


def widen_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (as torch does)."""
    bits = x.view(np.uint32)
    rounded = bits + (((bits >> 16) & 1) + 0x7FFF)
    out = (rounded >> 16).astype(np.uint16)
    # Keep NaNs NaN (rounding could carry a NaN's payload into the infinity pattern).
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)
