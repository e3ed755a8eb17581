"""Texts to token ids with the model's own tokenizer.json: truncation, prompts, CHUNK_MEAN
windows and contextual-chunk documents.

The HF `tokenizers` library releases the GIL while it encodes, so the frontend runs these on a
thread pool and the event loop stays free. Every method takes `limit`, the token limit per
sequence with special tokens included (the model's, or the request's max_tokens).

Bounded work. The tokenizer holds about 500 bytes per token and 60 per character while it
encodes, so the frontend never hands it more than the model can see:
- a text that may not fit is cut at a *cut point* before it is tokenized: END and NONE tokenize
  a prefix, START a suffix, of about `CHARS_PER_TOKEN` characters per token of room, growing 4x
  until the piece holds more tokens than the room (or is the whole text);
- CHUNK_MEAN needs every token of a text: it is tokenized in pieces of about `PIECE_CHARS`;
- strings go to the library in groups of at most `GROUP_CHARS` characters, and the ids come back
  as int32 arrays (4 bytes a token) before the next group starts. A rerank request's documents
  that tokie takes go to it in one call (`first_ids_flat`): tokie keeps no alignment state per
  character, only the ids and their bookkeeping, so that call holds a small multiple of the
  request's own size, which --max-request-bytes bounds;
- the prompt is prepended to each text's piece (sentence-transformers tokenizes prompt and text
  together, and a prompt's last word can merge with a text's first), so it is bounded: at most
  `PROMPT_MAX_CHARS` characters and fewer tokens than the room.

A cut point is where the tokenizer is known to start a new word whatever comes before or after:
before ASCII whitespace, an ASCII punctuation mark or a CJK ideograph (when the normalizer splits
those), for BERT's normalizer and pre-tokenizer (which split there, and change no character
there), but never inside a special token written in the text. Tokens of a piece that ends or
starts at a cut point are then exactly the first or last tokens of the whole text. A run of
characters without a cut point (and every text, for tokenizers whose cut points we do not know)
is tokenized whole: about 60 bytes a character while it lasts.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
from tokenizers import Tokenizer

from pollen.common.errors import invalid
from pollen.server.pipeline.ascii_bpe import AsciiBpe
from pollen.server.pipeline.tokie_ids import TokieIds
from pollen.v1 import embedder_pb2 as pb

# CHUNK_MEAN: consecutive windows share this fraction of a window's text tokens.
WINDOW_OVERLAP_DIVISOR = 8
# Characters handed to the tokenizer in one call at most (a run without a cut point may be more).
GROUP_CHARS = 1 << 16
# A text that may not fit is first cut to this many characters per token of room.
CHARS_PER_TOKEN = 8
# CHUNK_MEAN tokenizes a long text in pieces of about this many characters.
PIECE_CHARS = 1 << 15
PROMPT_MAX_CHARS = 4096
# A lone text (with its prompt) of at most this many characters is tokenized in one call with its
# special tokens (a query's path); the tokenizer's cost for it is bounded by its length.
SHORT_CHARS = 2048
# BERT splits words before and after whitespace, ASCII punctuation and CJK ideographs (its
# BertPreTokenizer, and BertNormalizer's handle_chinese_chars), and its normalizer leaves these
# characters as they are. Unicode punctuation outside ASCII is left out: its category may differ
# between Python's Unicode tables and the tokenizer's.
_BERT_CUTS = re.compile("[ \t\n\r!-/:-@\\[-`{-~\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
                        "\U00020000-\U0002a6df\U0002a700-\U0002ceaf\U0002f800-\U0002fa1f]")


_BERT_CUTS_NO_CJK = re.compile("[ \t\n\r!-/:-@\\[-`{-~]")


def cut_pattern(config: dict) -> re.Pattern | None:
    """The characters a piece may start at (see the module docstring); None: no cut is known safe.
    Added tokens (`[MASK]`) are matched in the raw text before anything else: they must be
    matched as they are written (not normalized, no stripping), and a cut never falls inside one
    (TextTokenizer.cut_at)."""
    normalizer = config.get("normalizer") or {}
    if (config.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer" or \
            normalizer.get("type") not in (None, "BertNormalizer"):
        return None
    if any(t["normalized"] or t["lstrip"] or t["rstrip"] or t["single_word"] for t in config.get("added_tokens", ())):
        return None
    return _BERT_CUTS if normalizer.get("handle_chinese_chars") else _BERT_CUTS_NO_CJK


class TextTokenizer:
    def __init__(self, model_dir: str, max_tokens: int, *, chars_per_token: int = CHARS_PER_TOKEN,
                 piece_chars: int = PIECE_CHARS, group_chars: int = GROUP_CHARS, tiktoken: bool = True,
                 tokie: bool = True, report: bool = True):
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
        config = json.loads(self.tokenizer.to_str())
        self.cuts = cut_pattern(config)
        self.added = [t["content"] for t in config.get("added_tokens", ()) if len(t["content"]) > 1]
        # tiktoken for a query's text when it is ASCII and the file byte-level BPE, where it gives
        # the same ids (server/pipeline/ascii_bpe.py; None: every text through the tokenizer.json). Only
        # there: tiktoken holds the GIL while it encodes, and the long texts that go to the
        # tokenizer threads must leave the event loop free.
        self.ascii_bpe = AsciiBpe.build(config, self.tokenizer) if tiktoken else None
        # tokie for the texts whose characters it was shown at load to encode as the tokenizer.json
        # does (server/pipeline/tokie_ids.py; None: every text through the tokenizers library).
        self.tokie = TokieIds.build(path, config, self.tokenizer, report) if tokie else None
        self._around = (self.prefix.tolist(), self.suffix.tolist())
        # The sizes of the pieces (tests make them tiny, so that cuts fall everywhere).
        self.chars_per_token, self.piece_chars, self.group_chars = chars_per_token, piece_chars, group_chars

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

    def prompt_tokens(self, prompt: str) -> int:
        """The prompt's tokens on its own (at most PROMPT_MAX_CHARS characters: admission checks)."""
        return len(self.ids([prompt])[0]) if prompt else 0

    @staticmethod
    def _check_texts(texts: list[str], field: str) -> None:
        for i, text in enumerate(texts):
            if not text:
                raise invalid(f"{field}[{i}] is empty: every text needs at least one character")

    def encode(self, texts: list[str], truncate: int, limit: int | None = None, prompt: str = "", *,
               chunk_mean_hint: bool = True) -> list[np.ndarray]:
        """Token ids (special tokens included) for each text, each at most `limit` long. The
        prompt is prepended to the text before tokenization, as sentence-transformers does.
        chunk_mean_hint: a refusal suggests long_input CHUNK_MEAN (Tokenize has no such option)."""
        limit = limit or self.max_tokens
        room = self.room(limit)
        self._check_texts(texts, "texts")
        if len(texts) == 1 and len(prompt) + len(texts[0]) <= SHORT_CHARS:
            # One short text (a query): one call of the tokenizer, special tokens and all; only a
            # text that turns out too long takes the path below, which cuts it exactly. The fast
            # batch call skips the offsets, which we never read.
            text = prompt + texts[0]
            fast = self.ascii_bpe.ids(text) if self.ascii_bpe is not None else None
            if fast is not None:
                ids = np.array(self._around[0] + fast + self._around[1], dtype=np.int32)
            else:
                ids = np.asarray(self.tokenizer.encode_batch_fast([text])[0].ids, dtype=np.int32)
            if len(ids) <= limit:
                return [ids]
        start = truncate == pb.TRUNCATE_START
        out = []
        for i, (ids, whole) in enumerate(self._tails(prompt, texts, room) if start else
                                         self._heads(prompt, texts, room)):
            if len(ids) > room:
                if truncate == pb.TRUNCATE_NONE:
                    count = f"{len(ids) + self.special}" if whole else f"more than {limit}"
                    hint = ", or set long_input to LONG_INPUT_CHUNK_MEAN" if chunk_mean_hint else ""
                    raise invalid(
                        f"texts[{i}] has {count} tokens, over {self.limit_name(limit)}; "
                        f"shorten it or set truncate to TRUNCATE_END or TRUNCATE_START{hint}")
                ids = ids[-room:] if start else ids[:room]
            out.append(self.wrap(ids))
        return out

    def first_ids(self, texts: list[str], room: int, field: str = "texts") -> list[np.ndarray]:
        """Each text's first `room` tokens, without special tokens, tokenizing only about what
        fits (the pieces of a rerank pair: server/tasks/rerank.py)."""
        self._check_texts(texts, field)
        return [ids[:room] for ids, _ in self._heads("", texts, room)]

    def first_ids_flat(self, texts: list[str], room: int, field: str = "texts",
                       covered: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """first_ids as one int32 array of them all and each text's count, for a rerank request's
        documents, whose pairs are put together at once (server/tasks/rerank.py). `covered`: tokie's
        check found none of the texts held back (server/pipeline/tokie_ids.py `held`), so they go to tokie
        in one call, unchecked and ungrouped. A count may exceed `room`."""
        if covered and self.tokie is not None and texts:
            self._check_texts(texts, field)
            chars = (room + 1) * self.chars_per_token
            cuts = [self.cut_after(text, chars) for text in texts]
            flat, counts = self.tokie.flat_ids([t[:c] for t, c in zip(texts, cuts)])
            # A cut text whose piece came out at `room` tokens or fewer needs a longer piece (_heads).
            if all(c == len(t) or n > room for t, c, n in zip(texts, cuts, counts.tolist())):
                return flat, counts
        parts = self.first_ids(texts, room, field)
        counts = np.fromiter(map(len, parts), np.int64, len(parts))
        return (np.concatenate(parts) if parts else np.empty(0, np.int32)), counts

    def encode_windows(self, texts: list[str], limit: int, prompt: str = "") -> list[list[np.ndarray]]:
        """CHUNK_MEAN: each text as one sequence when it fits, else as overlapping windows.

        A window holds `room = limit - specials` text tokens plus the model's special tokens;
        window k starts at k * (room - room // 8), and the last one is the first that reaches the
        end of the text (it may be shorter).
        """
        room = self.room(limit)
        stride = room - room // WINDOW_OVERLAP_DIVISOR
        self._check_texts(texts, "texts")
        out = []
        for ids in self._whole(prompt, texts):
            starts = [0]
            while starts[-1] + room < len(ids):
                starts.append(starts[-1] + stride)
            out.append([self.wrap(ids[s:s + room]) for s in starts])
        return out

    def encode_document(self, chunks: list[str], limit: int,
                        prompt: str = "") -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Contextual chunks: one sequence = specials + prompt + chunk 1 + ... + chunk n + specials,
        each chunk tokenized on its own without special tokens; and each chunk's token span."""
        self._check_texts(chunks, "chunks")
        room = self.room(limit)
        head = self.ids([prompt])[0] if prompt else np.empty(0, np.int32)
        parts = self._heads("", chunks, room)
        spans, at = [], len(self.prefix) + len(head)
        for i, (p, _) in enumerate(parts):
            if len(p) == 0:
                raise invalid(f"chunks[{i}] has no tokens (only characters the tokenizer drops)")
            spans.append((at, at + len(p)))
            at += len(p)
        if at - len(self.prefix) > room:
            count = at + len(self.suffix) if all(whole for _, whole in parts) else f"more than {limit}"
            raise invalid(f"chunks: the document has {count} tokens, over {self.limit_name(limit)}; "
                          "a contextual-chunk document must fit in one sequence (truncation would drop chunks)")
        return self.wrap(np.concatenate([head, *(p for p, _ in parts)])), spans

    def _heads(self, prompt: str, texts: list[str], room: int) -> list[tuple[np.ndarray, bool]]:
        """Each text's ids, prompt first, without special tokens: all of them (and True), or,
        when the text is longer, more than `room` of them that are exactly its first ones."""
        out: list = [None] * len(texts)
        todo, chars = list(range(len(texts))), (room + 1) * self.chars_per_token
        while todo:
            cuts = [self.cut_after(texts[i], chars) for i in todo]
            pieces = self.ids([prompt + texts[i][:c] for i, c in zip(todo, cuts)])
            left = []
            for i, c, ids in zip(todo, cuts, pieces):
                whole = c == len(texts[i])
                if whole or len(ids) > room:
                    out[i] = (ids, whole)
                else:
                    left.append(i)
            todo, chars = left, chars * 4
        return out

    def _tails(self, prompt: str, texts: list[str], room: int) -> list[tuple[np.ndarray, bool]]:
        """As _heads, from the end: more than `room` ids that are exactly the text's last ones."""
        out: list = [None] * len(texts)
        todo, chars = list(range(len(texts))), (room + 1) * self.chars_per_token
        while todo:
            cuts = [self.cut_before(texts[i], len(texts[i]) - chars) for i in todo]
            pieces = self.ids([texts[i][c:] if c else prompt + texts[i] for i, c in zip(todo, cuts)])
            left = []
            for i, c, ids in zip(todo, cuts, pieces):
                if c == 0 or len(ids) > room:
                    out[i] = (ids, c == 0)
                else:
                    left.append(i)
            todo, chars = left, chars * 4
        return out

    def _whole(self, prompt: str, texts: list[str]) -> list[np.ndarray]:
        """Every id of each text, prompt first, tokenized in pieces of about PIECE_CHARS."""
        pieces, owner = [], []
        for i, text in enumerate(texts):
            at = 0
            while at < len(text):
                cut = self.cut_after(text, at + self.piece_chars)
                pieces.append(text[at:cut] if at else prompt + text[:cut])
                owner.append(i)
                at = cut
        out: list[list[np.ndarray]] = [[] for _ in texts]
        for i, ids in zip(owner, self.ids(pieces)):
            out[i].append(ids)
        return [np.concatenate(parts) for parts in out]

    def cut_at(self, text: str, j: int) -> bool:
        """Whether `j` (the position of a cut character) is a cut point: not inside an added token
        written in the text, such as the `]` of `[MASK]`."""
        return not any(text.startswith(token, s) for token in self.added
                       for s in range(max(0, j - len(token) + 1), j))

    def cut_after(self, text: str, at: int) -> int:
        """The first cut point at or after `at`; len(text) when there is none."""
        if at >= len(text) or self.cuts is None:
            return len(text)
        for found in self.cuts.finditer(text, at):
            if self.cut_at(text, found.start()):
                return found.start()
        return len(text)

    def cut_before(self, text: str, at: int) -> int:
        """The last cut point after 0 and at or before `at`; 0 (the whole text) when there is none."""
        if at <= 0 or self.cuts is None:
            return 0
        hi = at + 1
        while hi > 1:
            lo = max(1, hi - 4096)
            found = [m.start() for m in self.cuts.finditer(text, lo, hi) if self.cut_at(text, m.start())]
            if found:
                return found[-1]
            hi = lo
        return 0

    def ids(self, strings: list[str]) -> list[np.ndarray]:
        """Each string's ids without special tokens, encoded in groups of about GROUP_CHARS
        characters so that the tokenizer's own state stays bounded."""
        out, group, chars = [], [], 0
        for s in strings:
            if group and chars + len(s) > self.group_chars:
                out += self._encode_group(group)
                group, chars = [], 0
            group.append(s)
            chars += len(s)
        return out + self._encode_group(group) if group else out

    def _encode_group(self, group: list[str]) -> list[np.ndarray]:
        out = self.tokie.ids(group) if self.tokie is not None else [None] * len(group)
        rest = [i for i, ids in enumerate(out) if ids is None]
        if rest:
            # The fast batch call skips the character offsets, which nothing here reads: a fifth less time.
            for i, e in zip(rest, self.tokenizer.encode_batch_fast([group[i] for i in rest], add_special_tokens=False)):
                out[i] = np.asarray(e.ids, dtype=np.int32)
        return out

    def wrap(self, ids: np.ndarray) -> np.ndarray:
        return np.concatenate([self.prefix, ids, self.suffix]).astype(np.int32)
