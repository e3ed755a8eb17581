"""tokie in front of a tokenizer.json, for the characters it was shown to treat alike.

The HF `tokenizers` library keeps alignment bookkeeping through its normalizer, pre-tokenizer and
model for every character, so long texts (a rerank call's documents) cost a frontend's threads
more than anything else it does for them. tokie reads the same tokenizer.json (WordPiece, BPE,
Unigram) and encodes many times faster (docs/performance.md), but does not give the very same ids for every
character: its Unicode tables differ from the HF library's for some (a Roman numeral's category
in Qwen3's pre-tokenizer regex, code points one library knows as unassigned). The HF library stays
the reference, and this file only decides where tokie agrees with it:

- at start, each character of PROBED_RANGES (the scripts, punctuation and symbols of everyday
  text) is encoded by both in a probe of its own, in several contexts (inside a word, after a
  space, doubled, by a digit); a character whose probe differs is left out. The check is part
  of each frontend's start, most of it the HF library encoding the probes;
- a text goes to tokie only when every one of its characters passed and it holds none of the
  file's added tokens (`[MASK]`, `<|im_end|>`), which the HF library splits off before its
  normalizer; any other text, and every text when tokie cannot load the file, goes to the HF
  library.

Threads: tokie encodes a call of many texts on threads it spawns for the call, one for each core
the calling thread may use (its CPU affinity), and a few texts on the calling thread, with the GIL
released. It is handed a group of texts in one call (server/pipeline/tokenizer.py GROUP_CHARS; a rerank
request's documents all at once, `flat_ids`), never a text at a time: a thread that released the
GIL waits to take it back behind an event loop busy with Python, up to the interpreter's switch
interval (5 ms), once per call.

Special tokens (the post-processor's) are the caller's to add, as for `encode(..., add_special_tokens=False)`.
"""
from __future__ import annotations

import logging
import re

import numpy as np

log = logging.getLogger("pollen.tokenizer")

# Code points checked at start: Latin, Greek, Cyrillic, Hebrew, Arabic, Devanagari, Thai, Latin
# Extended Additional (Vietnamese), punctuation, currency, letterlike symbols, arrows and math,
# CJK punctuation, kana, CJK ideographs, Hangul, full-width forms, emoji. Control characters are
# in the first range. Combining marks are left out: a text that holds one goes to the HF library.
PROBED_RANGES = ((0x0000, 0x024F), (0x0370, 0x052F), (0x0590, 0x06FF), (0x0900, 0x097F), (0x0E00, 0x0E7F),
                 (0x1E00, 0x1EFF), (0x2000, 0x22FF), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
                 (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF))
# Up to this many characters are each looked for in a text before a search for them (TokieIds.held).
PRESENT_MAX = 8
# Past this many added tokens the search of every text for them could cost more than tokie saves.
ADDED_MAX = 256


def contexts(c: str) -> str:
    """One character where pre-tokenizers and normalizers look at its neighbours: inside a word,
    after a space, doubled (Greek's final sigma), before and after a digit."""
    return f"a{c}b {c}{c}1{c} "


class TokieIds:
    """tokie's encoder for a tokenizer.json; `ids(texts)` leaves None where the HF library must encode."""

    def __init__(self, encoder, agreed: list[str], added: list[str]):
        self.encoder = encoder
        # agreed[code point]: tokie was shown to encode it as the HF library does (False past the table).
        self.agreed = np.zeros(max(map(ord, agreed)) + 2, bool)
        self.agreed[[ord(c) for c in agreed]] = True
        held_ascii = [chr(c) for c in range(128) if not self.agreed[c]]
        # The ASCII characters held back, searched for in an ASCII group without the table.
        self.held_ascii = re.compile("[" + re.escape("".join(held_ascii)) + "]") if held_ascii else None
        self.added = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True)))) if added else None
        # What a text must hold for either search to match: a held-back character, an added
        # token's first. A text's `in` for one character is a memchr, several times faster than a
        # pattern's scan, so the scans run only where one of these is present (past PRESENT_MAX
        # of them, the scan runs always: None).
        self.held_ascii_chars = few(held_ascii)
        self.added_firsts = few(sorted({t[0] for t in added}))

    @classmethod
    def build(cls, path: str, config: dict, reference, report: bool = True) -> TokieIds | None:
        """For the tokenizer.json at `path` (its parsed `config`); `reference` (a tokenizers.Tokenizer
        of the same file, without truncation) is what tokie must agree with. None when tokie is
        missing, cannot read the file, or agrees on no character. `report`: log what the probe
        found (one process of a server does: every frontend finds the same)."""
        level = logging.INFO if report else logging.DEBUG
        added = [t["content"] for t in config.get("added_tokens", ())]
        if len(added) > ADDED_MAX:
            return None
        try:
            import tokie
            encoder = tokie.Tokenizer.from_json(path)
            encoder.no_truncation()
            encoder.no_padding()
        except Exception as exc:  # noqa: BLE001 - tokie's loader raises its own error types
            log.log(level, "tokie cannot read %s (%s): tokenizing with the tokenizers library only", path, exc)
            return None
        chars = [chr(c) for lo, hi in PROBED_RANGES for c in range(lo, hi + 1)]
        probes = [contexts(c) for c in chars]
        ours = split_flat(*encode_flat(encoder, probes))
        theirs = reference.encode_batch_fast(probes, add_special_tokens=False)
        differ = [c for c, a, b in zip(chars, ours, theirs) if a.tolist() != b.ids]
        agreed = sorted(set(chars) - set(differ))
        if not agreed:
            return None
        if differ:
            # Rare characters (unassigned code points, controls) cost only the texts that hold
            # them: worth a line only where everyday ASCII text would take the slower path.
            everyday = any(" " <= c <= "~" for c in differ)
            log.log(level if everyday else logging.DEBUG, "tokie encodes %d probed characters of %s unlike the "
                    "tokenizers library (%s): texts holding them are tokenized by the tokenizers library",
                    len(differ), path,
                    " ".join(f"U+{ord(c):04X}" for c in differ[:12]) + (" ..." if len(differ) > 12 else ""))
        return cls(encoder, agreed, added)

    def held(self, texts: list[str]) -> set[int]:
        """The indices of the texts that must go to the HF library: one holds a character tokie was
        not shown to agree on, or an added token. Checked on the texts joined: the few held-back
        ASCII characters by a search (where one is present at all), then a table lookup for each
        non-ASCII character alone (a lookup for every character costs several times that on mostly
        ASCII text, and a regex of the agreed characters' runs ten times), then the added tokens
        by a search (where one's first character is present)."""
        joined = "".join(texts)
        bad = [m.start() for m in self.held_ascii.finditer(joined)] if present(self.held_ascii_chars, joined) else []
        if not joined.isascii():
            codes = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), np.uint32)
            wide = np.flatnonzero(codes > 0x7F)
            bad += wide[~self.agreed[np.minimum(codes[wide], len(self.agreed) - 1)]].tolist()
        if present(self.added_firsts, joined):  # a match across two texts' seam only sends both to the HF library
            bad += [m.start() for m in self.added.finditer(joined)]
        if not bad:
            return set()
        ends = np.cumsum([len(t) for t in texts])
        return set(np.searchsorted(ends, bad, side="right").tolist())

    def covers(self, text: str) -> bool:
        return not self.held([text])

    def ids(self, texts: list[str]) -> list[np.ndarray | None]:
        """The ids (int32) of each text tokie may encode, without special tokens; None for the others."""
        out: list[np.ndarray | None] = [None] * len(texts)
        held = self.held(texts)
        mine = [i for i in range(len(texts)) if i not in held]
        if mine:
            for i, ids in zip(mine, split_flat(*self.flat_ids([texts[i] for i in mine]))):
                out[i] = ids
        return out

    def flat_ids(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of texts that `held` found none in, from one call (see the module docstring's
        Threads): `encode_flat`'s."""
        return encode_flat(self.encoder, texts)


def few(chars: list[str]) -> list[str] | None:
    return chars if len(chars) <= PRESENT_MAX else None


def present(chars: list[str] | None, text: str) -> bool:
    """Whether `text` may hold one of `chars` (TokieIds.__init__): True for None."""
    return chars is None or any(c in text for c in chars)


def encode_flat(encoder, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The texts' ids (int32, without special tokens) one after the other, and each text's count
    (int64), from one encode_batch_flat call. Its second array holds the texts' lengths (tokie
    0.1) or their n + 1 offsets."""
    flat, bounds = encoder.encode_batch_flat(texts, add_special_tokens=False)
    bounds = np.asarray(bounds, np.int64)
    counts = np.diff(bounds) if len(bounds) == len(texts) + 1 else bounds
    return flat.astype(np.int32, copy=False), counts


def split_flat(flat: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """`encode_flat`'s ids, one array (a view) a text."""
    return np.split(flat, np.cumsum(counts)[:-1]) if len(counts) else []
