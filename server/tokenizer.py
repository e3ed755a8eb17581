"""Texts to token ids with the model's own tokenizer.json: truncation, prompts, CHUNK_MEAN
windows and contextual-chunk documents.

The HF `tokenizers` library releases the GIL while it encodes, so the frontend runs these on a
thread pool and the event loop stays free. Every method takes `limit`, the token limit per
sequence with special tokens included (the model's, or the request's max_tokens).
"""
from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer

from pollen.server.errors import invalid
from pollen.v1 import embedder_pb2 as pb

# CHUNK_MEAN: consecutive windows share this fraction of a window's text tokens.
WINDOW_OVERLAP_DIVISOR = 8


class TextTokenizer:
    def __init__(self, model_dir: str, max_tokens: int):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{model_dir}: no tokenizer.json (pollen needs the fast-tokenizer file)")
        self.tokenizer = Tokenizer.from_file(path)
        # The file may carry padding and truncation settings of its own; we apply ours.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.max_tokens = max_tokens
        self.special = self.tokenizer.num_special_tokens_to_add(False)
        self.prefix, self.suffix = self._specials_around()

    def _specials_around(self) -> tuple[np.ndarray, np.ndarray]:
        """The special tokens the post-processor puts before and after one sequence's text
        ([CLS] and [SEP] for BERT), found by post-processing a one-token text."""
        enc = self.tokenizer.post_process(self.tokenizer.encode("a", add_special_tokens=False))
        mask = enc.special_tokens_mask
        first = mask.index(0) if 0 in mask else len(mask)
        last = len(mask) - mask[::-1].index(0) if 0 in mask else len(mask)
        ids = np.asarray(enc.ids, dtype=np.int32)
        return ids[:first], ids[last:]

    def limit_name(self, limit: int) -> str:
        return f"the model's limit of {limit}" if limit == self.max_tokens else f"the request's max_tokens {limit}"

    def room(self, limit: int) -> int:
        return limit - self.special

    @staticmethod
    def _check_texts(texts: list[str], field: str) -> None:
        for i, text in enumerate(texts):
            if not text:
                raise invalid(f"{field}[{i}] is empty: every text needs at least one character")

    def encode(self, texts: list[str], truncate: int, limit: int | None = None, prompt: str = "") -> list[np.ndarray]:
        """Token ids (special tokens included) for each text, each at most `limit` long. The
        prompt is prepended to the text before tokenization, as sentence-transformers does."""
        limit = limit or self.max_tokens
        room = self.room(limit)
        out = []
        for i, enc in enumerate(self._encode_texts(texts, prompt)):
            if len(enc.ids) > room:
                if truncate == pb.TRUNCATE_NONE:
                    raise invalid(
                        f"texts[{i}] has {len(enc.ids) + self.special} tokens, over {self.limit_name(limit)}; "
                        "shorten it, set truncate to TRUNCATE_END or TRUNCATE_START, "
                        "or set long_input to LONG_INPUT_CHUNK_MEAN")
                enc.truncate(room, direction="right" if truncate == pb.TRUNCATE_END else "left")
            out.append(self._with_specials(enc))
        return out

    def encode_windows(self, texts: list[str], limit: int, prompt: str = "") -> list[list[np.ndarray]]:
        """CHUNK_MEAN: each text as one sequence when it fits, else as overlapping windows.

        A window holds `room = limit - specials` text tokens plus the model's special tokens;
        window k starts at k * (room - room // 8), and the last one is the first that reaches the
        end of the text (it may be shorter).
        """
        room = self.room(limit)
        stride = room - room // WINDOW_OVERLAP_DIVISOR
        out = []
        for enc in self._encode_texts(texts, prompt):
            if len(enc.ids) <= room:
                out.append([self._with_specials(enc)])
                continue
            ids = np.asarray(enc.ids, dtype=np.int32)
            starts = [0]
            while starts[-1] + room < len(ids):
                starts.append(starts[-1] + stride)
            out.append([self.wrap(ids[s:s + room]) for s in starts])
        return out

    def encode_document(self, chunks: list[str], limit: int, prompt: str = "") -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Contextual chunks: one sequence = specials + prompt + chunk 1 + ... + chunk n + specials,
        each chunk tokenized on its own without special tokens; and each chunk's token span."""
        self._check_texts(chunks, "chunks")
        pieces = self.tokenizer.encode_batch(([prompt] if prompt else []) + chunks, add_special_tokens=False)
        head = np.asarray(pieces[0].ids, dtype=np.int32) if prompt else np.empty(0, np.int32)
        parts = [np.asarray(e.ids, dtype=np.int32) for e in pieces[1 if prompt else 0:]]
        spans, at = [], len(self.prefix) + len(head)
        for i, p in enumerate(parts):
            if len(p) == 0:
                raise invalid(f"chunks[{i}] has no tokens (only characters the tokenizer drops)")
            spans.append((at, at + len(p)))
            at += len(p)
        seq = self.wrap(np.concatenate([head, *parts]))
        if len(seq) > limit:
            raise invalid(f"chunks: the document has {len(seq)} tokens, over {self.limit_name(limit)}; "
                          "a contextual-chunk document must fit in one sequence (truncation would drop chunks)")
        return seq, spans

    def _encode_texts(self, texts: list[str], prompt: str):
        """Checked texts, prompt prepended, tokenized without special tokens (truncation comes after)."""
        self._check_texts(texts, "texts")
        return self.tokenizer.encode_batch([prompt + t for t in texts], add_special_tokens=False)

    def _with_specials(self, enc) -> np.ndarray:
        return np.asarray(self.tokenizer.post_process(enc).ids, dtype=np.int32)

    def wrap(self, ids: np.ndarray) -> np.ndarray:
        return np.concatenate([self.prefix, ids, self.suffix]).astype(np.int32)
