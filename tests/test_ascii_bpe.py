"""tiktoken on a lone ASCII query (server/pipeline/ascii_bpe.py) gives the tokenizer.json's very ids.

The tokenizers here are byte-level BPEs trained by the HF library itself, with each regex tiktoken
is trusted with (Qwen3's, GPT-2's, Llama 3's), an NFC normalizer and an end-of-text token the
post-processor appends (as Qwen3-Embedding's does); the HF tokenizer is the reference. With the
real Qwen3 tokenizer.json (POLLEN_QWEN3_TOKENIZER=path, which load/run_gpu.sh needs), many more random
ASCII texts are compared. End to end, `pollen serve` on a tiny Qwen3 checkpoint with such a
tokenizer answers what HF transformers computes from the HF tokenizer's ids.
"""
from __future__ import annotations

import json
import logging
import os
import random

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from pollen.common.model_spec import default_model_path
from pollen.server.pipeline.ascii_bpe import ADDED_MAX, GPT2_PATTERN, KNOWN_PATTERNS, AsciiBpe
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.test_model_qwen3 import hf_rows, make_tiny_qwen3

EOT = "<|endoftext|>"
LIMIT = 4096
QWEN3, LLAMA3 = KNOWN_PATTERNS[1], KNOWN_PATTERNS[2]
_WORDS = ("search", "embedding", "server", "query", "the", "of", "and", "GPU", "token", "vector", "it's",
          "we'll", "1999", "3.5", "x86_64", "e-mail", "C++", "(note)", "don't", "HTTP/2", "ranked", "results")


def corpus(seed: int = 3, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14))) + rng.choice(("", ".", "?", "\n"))
            for _ in range(lines)]


def train(pattern: str, vocab_size: int = 700) -> Tokenizer:
    """A byte-level BPE trained on `corpus()`, splitting with `pattern` (GPT-2's: ByteLevel's own)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    if pattern == GPT2_PATTERN:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOT}", special_tokens=[(EOT, tok.token_to_id(EOT))])
    return tok


@pytest.fixture(scope="module", params=[QWEN3, GPT2_PATTERN, LLAMA3], ids=["qwen3", "gpt2", "llama3"])
def trained(request, tmp_path_factory):
    """(model dir holding the trained tokenizer.json, the HF tokenizer)"""
    path = tmp_path_factory.mktemp("bpe")
    tok = train(request.param)
    tok.save(str(path / "tokenizer.json"))
    return str(path), tok


_BUILT: dict[str, TextTokenizer] = {}


def fast_tokenizer(path: str) -> TextTokenizer:
    """One TextTokenizer per trained file (building one checks the probes)."""
    if path not in _BUILT:
        _BUILT[path] = TextTokenizer(path, LIMIT)
    return _BUILT[path]


def config_of(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())


def test_tiktoken_is_used_for_a_byte_level_bpe(trained):
    path, _ = trained
    assert TextTokenizer(path, LIMIT).ascii_bpe is not None
    assert TextTokenizer(path, LIMIT, tiktoken=False).ascii_bpe is None


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(max_codepoint=127), min_size=1, max_size=120))
def test_any_ascii_query_gets_the_tokenizer_json_ids(trained, text):
    path, tok = trained
    ids = fast_tokenizer(path).encode([text], pb.TRUNCATE_NONE, LIMIT)[0].tolist()
    assert ids == tok.encode(text).ids
    assert ids[-1] == tok.token_to_id(EOT)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=60))
def test_other_text_goes_to_the_tokenizer_json(trained, text):
    path, tok = trained
    tokenizer = fast_tokenizer(path)
    if not text.isascii():
        assert tokenizer.ascii_bpe.ids(text) is None
    assert tokenizer.encode([text], pb.TRUNCATE_NONE, LIMIT)[0].tolist() == tok.encode(text).ids


def test_an_added_token_written_in_the_text_is_the_tokenizer_json_s(trained):
    path, tok = trained
    tokenizer = fast_tokenizer(path)
    text = f"first {EOT} second"
    assert tokenizer.ascii_bpe.ids(text) is None
    ids = tokenizer.encode([text], pb.TRUNCATE_NONE, LIMIT)[0].tolist()
    assert ids == tok.encode(text).ids
    assert ids.count(tok.token_to_id(EOT)) == 2  # the one written and the one appended


def test_a_wordpiece_tokenizer_is_left_to_the_tokenizer_json():
    assert TextTokenizer(default_model_path(), 256).ascii_bpe is None  # all-MiniLM-L6-v2's


def test_tokenizers_it_cannot_reproduce_are_left_to_the_tokenizer_json():
    tok = train(QWEN3)
    config = config_of(tok)
    prefixed = json.loads(json.dumps(config))
    prefixed["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True
    other_regex = json.loads(json.dumps(config))
    other_regex["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+"
    lowercase = json.loads(json.dumps(config))
    lowercase["normalizer"] = {"type": "Lowercase"}
    fallback = json.loads(json.dumps(config))
    fallback["model"]["byte_fallback"] = True
    many_added = json.loads(json.dumps(config))  # each query is searched for every added token
    many_added["added_tokens"] += [dict(many_added["added_tokens"][0], id=10_000 + i, content=f"<extra_{i}>")
                                   for i in range(ADDED_MAX)]
    for changed in (prefixed, other_regex, lowercase, fallback, many_added):
        assert AsciiBpe.build(changed, Tokenizer.from_str(json.dumps(changed))) is None


def test_merges_that_disagree_with_the_ranks_are_caught_at_load(caplog):
    """HF applies merges in the file's order, tiktoken by rank (the merged token's id): a file
    whose order differs is found on the probes, and tiktoken is not used."""
    config = config_of(train(QWEN3))
    config["model"]["merges"] = config["model"]["merges"][::-1]
    with caplog.at_level(logging.WARNING, logger="pollen.tokenizer"):
        assert AsciiBpe.build(config, Tokenizer.from_str(json.dumps(config))) is None
    assert "tokenizing with the tokenizer.json only" in caplog.text


@pytest.mark.skipif(not os.environ.get("POLLEN_QWEN3_TOKENIZER"), reason="needs POLLEN_QWEN3_TOKENIZER (the "
                    "real Qwen3 tokenizer.json, which load/run_gpu.sh needs)")
def test_the_real_qwen3_tokenizer_on_many_ascii_texts(tmp_path):
    from load.bench_concurrency import query_texts

    (tmp_path / "tokenizer.json").write_bytes(open(os.environ["POLLEN_QWEN3_TOKENIZER"], "rb").read())
    tokenizer = TextTokenizer(str(tmp_path), 32768)
    assert tokenizer.ascii_bpe is not None
    rng = random.Random(11)
    printable = "".join(map(chr, range(32, 127))) + "\t\n\r"
    texts = query_texts() + ["".join(rng.choice(printable) for _ in range(rng.randint(1, 200))) for _ in range(20000)]
    for text in texts:
        assert tokenizer.encode([text], pb.TRUNCATE_NONE, 32768)[0].tolist() == \
            tokenizer.tokenizer.encode(text).ids, text


def test_served_queries_match_hf_transformers_on_the_tokenizer_json_ids(tmp_path):
    """End to end: the ids tiktoken gives the worker are the ones HF transformers is fed."""
    tok = train(QWEN3)
    model = make_tiny_qwen3(tmp_path, vocab_size=tok.get_vocab_size())
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    texts = ["ranked search results", "it's the GPU's token vector?", "C++ and HTTP/2 (note)", "x86_64 1999",
             "  spaced\tout\n", "don't"]
    server = ServerProcess("--model", str(tmp_path)).start()
    try:
        with grpc.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            got = [np.frombuffer(stub.Embed(pb.EmbedRequest(texts=[t]), timeout=60).embeddings, np.float32)
                   for t in texts]
    finally:
        server.terminate()
    want = hf_rows(model, [torch.tensor(tok.encode(t).ids) for t in texts], "causal").numpy()
    np.testing.assert_allclose(np.stack(got), want, atol=1e-4, rtol=1e-4)
