"""TEI's tokens: an encoding's tokens with the text each covers and its UTF-8 byte offsets into the
text tokenized, as TEI's HTTP /tokenize and tei.v1 Tokenize give them (a special token has its
own text and no offsets)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class TeiToken(NamedTuple):
    id: int
    text: str
    special: bool
    start: int | None  # UTF-8 byte offsets; None for a special token
    stop: int | None


def byte_offsets(text: str) -> np.ndarray:
    """offsets[i]: the UTF-8 byte offset of character i of `text` (and len(text): its byte size)."""
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    sizes = 1 + (points >= 0x80).astype(np.int64) + (points >= 0x800) + (points >= 0x10000)
    return np.concatenate([[0], np.cumsum(sizes)])


def tei_tokens(text: str, encoding) -> list[TeiToken]:
    """`encoding` (a tokenizers Encoding of `text`, character offsets) as TEI's tokens."""
    at = byte_offsets(text)
    out = []
    for token_id, (start, stop), special, token in zip(encoding.ids, encoding.offsets, encoding.special_tokens_mask,
                                                       encoding.tokens):
        if special:
            out.append(TeiToken(token_id, token, True, None, None))
        else:
            out.append(TeiToken(token_id, text[start:stop], False, int(at[start]), int(at[stop])))
    return out
