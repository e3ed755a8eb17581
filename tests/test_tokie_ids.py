"""tokie in front of the tokenizer.json (server/pipeline/tokie_ids.py) gives the HF tokenizers library's very ids.

The tokenizers here: all-MiniLM-L6-v2's real BERT WordPiece file, and files the HF library trains
itself on multilingual text (a byte-level BPE on Qwen3's regex, a SentencePiece-style Unigram with
NFKC and Metaspace as XLM-R's, a cased WordPiece); with POLLEN_QWEN3_TOKENIZER=path (load/run_gpu.sh
needs it) the real Qwen3 file too. The HF library is the reference throughout.
"""
from __future__ import annotations

import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from load import corpus as load_corpus
from pollen.common.model_spec import default_model_path
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.server.pipeline.tokie_ids import PRESENT_MAX, PROBED_RANGES, TokieIds, encode_flat, split_flat
from pollen.v1 import embedder_pb2 as pb
from tests.test_ascii_bpe import QWEN3
from tests.test_ascii_bpe import train as train_bpe

LIMIT = 512
TRICKY = ["Hello,   world!\t\tTabs\nnewlines\r\n", "café déjà vu naïve façade", "東京の天気は晴れ", "北京大学 中文",
          "서울 지하철", "Москва река", "Ελληνικά ΣΟΦΙΑ", "مرحبا بالعالم", "שלום עולם", "हिन्दी भाषा", "ภาษาไทย",
          "🙂🚀👍 emoji", "zero\u200bwidth\u200djoin", "ctrl\x00\x01\x07\x1b chars", "a" * 250, "x" * 120 + " y",
          "https://example.com/a/b?c=d&e=f#g", "def f(x):\n    return x**2  # code", "1234567890 3.14159 $100 50%",
          "  leading and trailing  ", "ALL CAPS", "don't won't y'all", "“curly quotes” ‘single’ — dash …",
          "\u00a0nbsp\u2003emspace\u3000ideographic", "ß ẞ İ ı ǅ", "ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３", "①②③ ⅫⅣ ⅻ",
          "cafe\u0301 combining", "tab\tsep\tvalues", "...!!!???", "-" * 80, "é" * 120, "Việt Nam Tiếng Việt"]


def multilingual(n: int = 400, seed: int = 5) -> list[str]:
    """Passages and queries in several scripts (load/corpus.py), the tricky strings, and random
    strings of characters from the probed ranges and beyond them."""
    rng = random.Random(seed)
    spans = [(0x20, 0x7E), (0xA0, 0x2FF), (0x370, 0x52F), (0x2000, 0x2BFF), (0x3000, 0x9FFF), (0xAC00, 0xD7A3),
             (0x1F300, 0x1FAFF), (0x0, 0x1F)]
    soup = ["".join(chr(rng.randint(*rng.choice(spans))) for _ in range(rng.randint(1, 60))) for _ in range(n)]
    return load_corpus.documents(n) + load_corpus.queries(n) + TRICKY + soup


def train_unigram() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(load_corpus.documents(600, seed=1) + TRICKY, trainers.UnigramTrainer(
        vocab_size=1500, special_tokens=["<s>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return tok


def train_wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(multilingual(600, seed=2), trainers.WordPieceTrainer(
        vocab_size=900, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    return tok


KINDS = ["minilm-wordpiece", "bpe-qwen3-regex", "unigram-metaspace", "wordpiece-cased", "qwen3-real"]


@pytest.fixture(scope="module", params=KINDS)
def tokenizer_dir(request, tmp_path_factory) -> str:
    if request.param == "minilm-wordpiece":
        return default_model_path()
    if request.param == "qwen3-real":
        if not os.environ.get("POLLEN_QWEN3_TOKENIZER"):
            pytest.skip("needs POLLEN_QWEN3_TOKENIZER (the real Qwen3 tokenizer.json, which load/run_gpu.sh needs)")
        path = tmp_path_factory.mktemp("qwen3")
        (path / "tokenizer.json").write_bytes(open(os.environ["POLLEN_QWEN3_TOKENIZER"], "rb").read())
        return str(path)
    tok = {"bpe-qwen3-regex": lambda: train_bpe(QWEN3), "unigram-metaspace": train_unigram,
           "wordpiece-cased": train_wordpiece}[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    tok.save(str(path / "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="module")
def both(tokenizer_dir) -> tuple[TextTokenizer, Tokenizer]:
    """(pollen's tokenizer with tokie on, the HF library's tokenizer of the same file)"""
    reference = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    reference.no_truncation()
    reference.no_padding()
    return TextTokenizer(tokenizer_dir, LIMIT), reference


def test_tokie_reads_each_file(both):
    tokenizer, _ = both
    assert tokenizer.tokie is not None


def test_every_text_gets_the_tokenizers_librarys_ids(both):
    tokenizer, reference = both
    texts = multilingual()
    got = tokenizer.ids(texts)
    want = [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    for text, g, w in zip(texts, got, want):
        assert g.tolist() == w, text
    covered = len(texts) - len(tokenizer.tokie.held(texts))
    assert covered > len(texts) // 2  # most went to tokie: the comparison above is of its ids


def test_truncated_texts_get_the_tokenizers_librarys_ids(both):
    """Texts cut to a limit (only a prefix or suffix of a long text is tokenized) hold the first or
    last ids of the HF library's whole encoding, between the file's special tokens."""
    tokenizer, reference = both
    texts = load_corpus.documents(100) + TRICKY
    for limit in (LIMIT, 24):
        room = limit - tokenizer.special
        for truncate, cut in ((pb.TRUNCATE_END, slice(None, room)), (pb.TRUNCATE_START, slice(-room, None))):
            for text, ids in zip(texts, tokenizer.encode(texts, truncate, limit)):
                whole = reference.encode(text, add_special_tokens=False).ids
                want = reference.post_process(reference.encode(text, add_special_tokens=False)).ids
                head, tail = want[:len(tokenizer.prefix)], want[len(want) - len(tokenizer.suffix):]
                assert ids.tolist() == head + whole[cut] + tail, text


def test_each_character_let_to_tokie_gets_the_tokenizers_librarys_ids_in_other_contexts(both):
    """Every probed character the gate lets through, in contexts the start's probes do not use
    (starting a text, ending a capitalised word, tripled, after punctuation), is encoded by tokie
    as by the HF library; a sentence holding a character it holds back gets the HF library's ids."""
    tokenizer, reference = both
    chars = [chr(c) for lo, hi in PROBED_RANGES for c in range(lo, hi + 1)]
    let = [c for c in chars if tokenizer.tokie.covers(c)]
    probes = [f"{c}x Word{c} {c}{c}{c}.{c}" for c in let]
    ours = split_flat(*encode_flat(tokenizer.tokie.encoder, probes))
    theirs = reference.encode_batch(probes, add_special_tokens=False)
    differ = [f"U+{ord(c):04X}" for c, a, b in zip(let, ours, theirs) if a.tolist() != b.ids]
    assert not differ
    held = [c for c in chars if not tokenizer.tokie.covers(c)][:50]
    texts = [f"a plain sentence with {c} in it" for c in held]
    for text, ids in zip(texts, tokenizer.ids(texts)):
        assert ids.tolist() == reference.encode(text, add_special_tokens=False).ids


def test_a_text_holding_an_added_token_goes_to_the_tokenizers_library(tmp_path):
    """The HF library matches added tokens in the raw text before its normalizer: such a text
    never goes to tokie."""
    tokenizer = TextTokenizer(default_model_path(), LIMIT)
    reference = Tokenizer.from_file(os.path.join(default_model_path(), "tokenizer.json"))
    reference.no_padding()
    reference.no_truncation()
    text = "the [MASK] sat on the [SEP] mat"
    assert not tokenizer.tokie.covers(text)
    [ids] = tokenizer.ids([text])
    assert ids.tolist() == reference.encode(text, add_special_tokens=False).ids
    assert reference.token_to_id("[MASK]") in ids.tolist()


def test_a_file_tokie_cannot_read_is_tokenized_by_the_tokenizers_library_alone(tmp_path):
    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = TextTokenizer(str(tmp_path), LIMIT)
    assert tokenizer.tokie is None
    assert [ids.tolist() for ids in tokenizer.ids(["hello world", "hello there"])] == [[0, 1], [0, 2]]


def test_tokie_off_leaves_every_text_to_the_tokenizers_library():
    assert TextTokenizer(default_model_path(), LIMIT, tokie=False).tokie is None


def test_the_texts_held_back_are_found_in_a_group():
    """A group is checked joined: each text holding a held-back character or an added token is
    named by its index, in an ASCII group and in one with other scripts."""
    tie = TextTokenizer(default_model_path(), LIMIT).tokie
    assert not tie.covers("\x7f") and tie.covers("plain text")  # DEL: the HF normalizer drops it, tokie does not
    assert tie.held(["plain", "has \x7f here", "plain", "x[MASK]y", "ok"]) == {1, 3}
    assert tie.held(["café", "東京 \x7f", "plain", "\U000e0001 tag", "[SEP]", "\ud800 lone"]) == {1, 3, 4, 5}
    assert tie.held(["no", "thing", "held"]) == set()


def test_many_held_back_characters_and_added_tokens_are_each_found():
    """Up to PRESENT_MAX held-back ASCII characters (or added tokens' first characters) are each
    looked for before the search; past that the search runs on every group, and finds them all."""
    held_back = "!#$%&()*+;="
    agreed = [chr(c) for c in range(128) if chr(c) not in held_back]
    added = [f"{c}tok>" for c in "ABCDEFGHIJ"]
    tie = TokieIds(None, agreed, added)
    assert len(held_back) > PRESENT_MAX and tie.held_ascii_chars is None and tie.added_firsts is None
    texts = ["plain", "a+b", "Jto", "xJtok>y", "ok", "x=y", "Atok> first"]
    assert tie.held(texts) == {1, 3, 5, 6}
    few = TokieIds(None, agreed, added[:2])  # two first characters: each looked for alone
    assert few.added_firsts == ["A", "B"] and few.held(["Btok>", "B tok>", "plain"]) == {0}


MEMORY_PROBE = """
import sys, tokie
def status(key):  # kB
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0])
encoder = tokie.Tokenizer.from_json(sys.argv[1])
words = ["bees", "make", "honey", "from", "nectar,", "which", "they", "store", "in", "the", "hive."]
texts = [" ".join(words[(i + k) % len(words)] for k in range(200)) for i in range(20000)]
chars = sum(map(len, texts))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from now
before = status("VmRSS")
flat, counts = encoder.encode_batch_flat(texts, add_special_tokens=False)
print(chars, len(flat), (status("VmHWM") - before) * 1024)
"""


def test_one_tokie_call_holds_a_small_multiple_of_its_text():
    """A rerank request's documents that tokie takes go to it in one call (server/pipeline/tokenizer.py
    first_ids_flat), bounded by the request's size: the call's peak memory, on some 20 M
    characters, stays within a few bytes a character (the HF library's encodings of the same
    texts hold several times that)."""
    import subprocess
    import sys

    path = os.path.join(default_model_path(), "tokenizer.json")
    run = subprocess.run([sys.executable, "-c", MEMORY_PROBE, path], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    chars, tokens, rise = map(int, run.stdout.split())
    assert tokens > chars // 8
    assert rise < 6 * chars, f"{rise / chars:.1f} bytes a character"


def test_the_probe_of_rare_characters_is_a_debug_line_whichever_frontend_probes(caplog):
    """all-MiniLM-L6-v2's probe differs only on DEL and unassigned code points: texts holding them
    are rare, so the finding is a DEBUG line, not one INFO line a frontend (eleven on a GPU host)."""
    import logging

    for report in (True, False):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="pollen.tokenizer"):
            assert TextTokenizer(default_model_path(), 256, report=report).tokie is not None
        probe = [r for r in caplog.records if r.getMessage().startswith("tokie encodes")]
        assert len(probe) == 1 and "U+007F" in probe[0].getMessage()
        assert probe[0].levelno == logging.DEBUG
