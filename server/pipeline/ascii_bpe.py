"""tiktoken in front of a byte-level BPE tokenizer.json, for ASCII text.

A short query's tokenization is the largest piece of a frontend's own work per call, and the HF
`tokenizers` library spends most of it in its regex pre-tokenizer (oniguruma). tiktoken runs the
same byte-level BPE (GPT-2 and cl100k-style regexes, ranks) with a faster regex engine. This file
only decides when tiktoken gives the very same ids, and otherwise says so (None) so that the
caller uses the HF tokenizer, which stays the reference:

- the file's pipeline must be one tiktoken reproduces: a BPE model without byte fallback, dropout
  or word affixes; no normalizer or only Unicode normalization (NFC, NFKC, NFD, NFKD: ASCII text
  is left as it is); a ByteLevel pre-tokenizer on one of KNOWN_PATTERNS, regexes that give every
  character to some piece (tiktoken drops what its regex does not match, HF keeps it);
- the text must be ASCII (the two regex engines agree on ASCII classes; outside it, `\\s` and
  `\\p{L}` come from two Unicode tables), and must not contain an added token (`<|endoftext|>`),
  which HF splits off before the model;
- the two must agree on PROBES, checked when the tokenizer loads: a file whose merges and ranks
  disagree is caught there, and tiktoken is then left unused (logged).

Special tokens (the post-processor's) are the caller's to add, as for `encode(..., add_special_tokens=False)`.
"""
from __future__ import annotations

import logging
import random
import re

log = logging.getLogger("pollen.tokenizer")

# The ByteLevel pre-tokenizer's own regex (use_regex true): GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Regexes that give every character to a piece, as Split(Isolated) patterns before a ByteLevel
# without its own regex: Qwen2/Qwen3's (cl100k-like) and Llama 3's.
KNOWN_PATTERNS = (
    GPT2_PATTERN,
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
_UNICODE_FORMS = {"NFC", "NFKC", "NFD", "NFKD"}
# Each query is searched for the file's added tokens (one regex of them all); past this many the
# search could cost more than the HF library's whole encode, and tiktoken is not used.
ADDED_MAX = 256
_ASCII_PRINTABLE = "".join(map(chr, range(32, 127)))
_PROBE_WORDS = ("the", "The", "THE", "search", "query", "embedding", "I'm", "don't", "we'll", "they've", "it's",
                "U.S.A.", "e-mail", "x86_64", "3.14159", "1999-12-31", "#1", "$100", "foo_bar", "CamelCase",
                "https://example.com/a?b=c&d=e", "tab\there", "new\nline", "cr\r\nlf", "  two  spaces  ", "...",
                "!!!", "''", '"quoted"', "a", "1234567", "(parens)", "[brackets]", "{braces}", "<angle>")


def byte_of_char() -> dict[str, int]:
    """ByteLevel's alphabet: the printable character each byte is written as in the vocabulary
    (itself for most printable Latin-1 bytes, 256 + n for the n-th other byte)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + n): b for n, b in enumerate(moved)})
    return table


def probes(seed: int = 7, count: int = 400) -> list[str]:
    """ASCII strings that exercise the regexes and the merges: words, contractions, numbers,
    punctuation and whitespace runs, and random printable text."""
    rng = random.Random(seed)
    out = list(_PROBE_WORDS)
    for _ in range(count):
        if rng.random() < 0.5:
            out.append(" ".join(rng.choice(_PROBE_WORDS) for _ in range(rng.randint(1, 12))))
        else:
            out.append("".join(rng.choice(_ASCII_PRINTABLE + "\t\n\r") for _ in range(rng.randint(1, 40))))
    return out


def pattern_of(config: dict) -> str | None:
    """The regex tiktoken must split with, or None when the pre-tokenizer is not one it reproduces."""
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True) \
            and not steps[0].get("add_prefix_space"):
        return GPT2_PATTERN
    if len(steps) != 2:
        return None
    split, level = steps
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert") \
            or level.get("type") != "ByteLevel" or level.get("use_regex") or level.get("add_prefix_space"):
        return None
    pattern = (split.get("pattern") or {}).get("Regex")
    return pattern if pattern in KNOWN_PATTERNS else None


def normalizer_keeps_ascii(config: dict) -> bool:
    normalizer = config.get("normalizer")
    if normalizer is None:
        return True
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    return all(step.get("type") in _UNICODE_FORMS for step in steps)


class AsciiBpe:
    """tiktoken's encoder for the file's vocabulary; `ids(text)` is None where it may differ."""

    def __init__(self, encoding, added: list[str]):
        self.encoding = encoding
        self.added = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True)))) if added else None

    @classmethod
    def build(cls, config: dict, reference) -> AsciiBpe | None:
        """For a tokenizer.json's parsed `config`; `reference` (a tokenizers.Tokenizer of the same
        file) checks it on PROBES. None when tiktoken is missing or cannot give the same ids."""
        model = config.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout") \
                or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            return None
        pattern = pattern_of(config)
        if pattern is None or not normalizer_keeps_ascii(config):
            return None
        try:
            import tiktoken
        except ImportError:
            return None
        alphabet = byte_of_char()
        try:
            ranks = {bytes(alphabet[c] for c in token): rank for token, rank in model["vocab"].items()}
        except KeyError:  # a vocabulary entry outside ByteLevel's alphabet: not a byte-level vocabulary
            return None
        if len(ranks) != len(model["vocab"]) or not all(bytes([b]) in ranks for b in range(128)):
            return None
        added = [t["content"] for t in config.get("added_tokens", ())]
        if len(added) > ADDED_MAX:
            return None
        fast = cls(tiktoken.Encoding("pollen", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}), added)
        for probe in probes():
            want = reference.encode(probe, add_special_tokens=False).ids
            if fast.ids(probe) not in (None, want):
                log.warning("tiktoken tokenizes %r as %s, the tokenizer.json as %s: tokenizing with the "
                            "tokenizer.json only", probe, fast.ids(probe), want)
                return None
        return fast

    def ids(self, text: str) -> list[int] | None:
        """The ids of `text` without special tokens, or None for the HF tokenizer to give them."""
        if not text.isascii() or (self.added is not None and self.added.search(text)):
            return None
        return self.encoding.encode_ordinary(text)
