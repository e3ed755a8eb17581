"""Request options against a checkpoint that declares them: sentence-transformers prompts,
Matryoshka sizes and a native (pplx-style) int8, on a copy of all-MiniLM-L6-v2's real weights."""
from __future__ import annotations

import json
import os

import grpc
import numpy as np
import pytest

from pollen.common.model_spec import default_model_path, read_model_spec
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, vectors

PROMPTS = {"query": "query: ", "document": "passage: "}
SIZES = [64, 128, 384]
TEXTS = ["how do magnets work", "東京 🙂", "a longer text about the weather in the mountains in spring"]


def dress(path, native_int8=True, default_prompt=None):
    """all-MiniLM-L6-v2 (its files linked, not copied) plus the config keys under test."""
    src = default_model_path()
    path.mkdir()
    for name in os.listdir(src):
        if name not in ("config.json", "config_sentence_transformers.json"):
            os.symlink(os.path.join(src, name), path / name)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["pollen_native_int8"] = native_int8
    (path / "config.json").write_text(json.dumps(config))
    st = {"prompts": PROMPTS, "matryoshka_dimensions": SIZES}
    if default_prompt:
        st["default_prompt_name"] = default_prompt
    (path / "config_sentence_transformers.json").write_text(json.dumps(st))
    return path


@pytest.fixture(scope="module")
def dressed(tmp_path_factory):
    return dress(tmp_path_factory.mktemp("dressed") / "model")


@pytest.fixture(scope="module")
def opts_stub(dressed):
    srv = ServerProcess("--model", str(dressed)).start()
    with grpc.insecure_channel(srv.listen) as channel:
        yield pb_grpc.EmbedderStub(channel)
    assert srv.terminate() == 0


def test_spec_reads_prompts_sizes_and_int8_kind(dressed, tmp_path):
    spec = read_model_spec(str(dressed))
    assert dict(spec.prompts) == PROMPTS and spec.default_prompt_name == ""
    assert list(spec.matryoshka_dimensions) == SIZES and spec.native_int8
    plain = read_model_spec(default_model_path())
    assert (plain.prompts, plain.matryoshka_dimensions, plain.native_int8) == ((), (), False)
    assert read_model_spec(str(dress(tmp_path / "d", False, "query"))).default_prompt_name == "query"


def test_info_lists_prompts_and_sizes(opts_stub):
    info = opts_stub.Info(pb.InfoRequest())
    assert dict(info.prompts) == PROMPTS
    assert list(info.matryoshka_dimensions) == SIZES
    assert pb.ENCODING_INT8 in info.encodings


def test_prompt_name_equals_sentence_transformers(opts_stub, dressed):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(dressed), device="cpu")
    assert st.prompts["query"] == "query: "
    ref = st.encode(TEXTS, prompt_name="query", normalize_embeddings=True)
    named = opts_stub.Embed(pb.EmbedRequest(texts=TEXTS, prompt_name="query", normalize=True))
    literal = opts_stub.Embed(pb.EmbedRequest(texts=TEXTS, prompt="query: ", normalize=True))
    plain = opts_stub.Embed(pb.EmbedRequest(texts=TEXTS, normalize=True))
    np.testing.assert_allclose(vectors(named), ref, atol=2e-5)
    np.testing.assert_array_equal(vectors(named), vectors(literal))
    assert np.abs(vectors(plain) - ref).max() > 1e-2  # the prompt really changed the input
    # The prompt's tokens count in usage, and Tokenize sees the same tokens.
    tokens = opts_stub.Tokenize(pb.TokenizeRequest(texts=TEXTS, prompt_name="query"))
    assert named.usage.prompt_tokens == sum(tokens.counts) > plain.usage.prompt_tokens
    assert tokens.tokens[0].ids[:3] == st.tokenizer("query: how")["input_ids"][:3]


@pytest.mark.parametrize("request_, fragment", [
    (pb.EmbedRequest(texts=["x"], prompt_name="search"), "prompt_name 'search' is not one of the model's prompts; "
                                                         "known: document, query"),
    (pb.EmbedRequest(texts=["x"], prompt_name="query", prompt="q: "), "either prompt_name or prompt, not both"),
    (pb.EmbedRequest(token_ids=[pb.TokenIds(ids=[101, 102])], prompt="q: "), "not to token_ids"),
    (pb.EmbedRequest(texts=["x"], dimensions=100), "dimensions 100 is not offered by this model; allowed: 0 "
                                                   "(full size) or one of 64, 128, 384"),
    (pb.EmbedRequest(texts=["x"], max_tokens=300), "max_tokens 300 is over the model's limit of 256"),
])
def test_bad_options_name_the_field(opts_stub, request_, fragment):
    with pytest.raises(grpc.RpcError) as err:
        opts_stub.Embed(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()


def test_declared_matryoshka_size_is_the_renormalized_prefix(opts_stub):
    full = vectors(opts_stub.Embed(pb.EmbedRequest(texts=TEXTS)))
    got = vectors(opts_stub.Embed(pb.EmbedRequest(texts=TEXTS, dimensions=64, normalize=True)))
    want = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dims", [0, 128])
def test_native_int8_is_round_127_tanh_of_the_mean_pool(opts_stub, dims):
    pooled = vectors(opts_stub.Embed(pb.EmbedRequest(texts=TEXTS)))  # not normalized
    want = np.round(127 * np.tanh(pooled[:, :dims] if dims else pooled))
    # normalize does not touch the model's own int8 (see worker/postprocess.py).
    for normalize in (False, True):
        reply = opts_stub.Embed(pb.EmbedRequest(texts=TEXTS, dimensions=dims, normalize=normalize,
                                                encoding=pb.ENCODING_INT8))
        q = np.frombuffer(reply.embeddings, np.int8).reshape(reply.rows, reply.dims).astype(np.float64)
        assert q.shape == want.shape and reply.encoding == pb.ENCODING_INT8
        assert np.abs(q - want).max() <= 1
        np.testing.assert_allclose(reply.scales, [1 / 127] * 3, rtol=1e-6)


def test_max_tokens_truncates_texts_ids_and_tokenize(opts_stub):
    long = "one two three four five six seven eight nine ten eleven twelve"
    end = opts_stub.Tokenize(pb.TokenizeRequest(texts=[long], truncate=pb.TRUNCATE_END, max_tokens=8)).tokens[0].ids
    start = opts_stub.Tokenize(pb.TokenizeRequest(texts=[long], truncate=pb.TRUNCATE_START, max_tokens=8)).tokens[0].ids
    full = opts_stub.Tokenize(pb.TokenizeRequest(texts=[long])).tokens[0].ids
    assert list(end) == list(full[:7]) + [full[-1]]
    assert list(start) == [full[0]] + list(full[-7:])
    by_text = opts_stub.Embed(pb.EmbedRequest(texts=[long], truncate=pb.TRUNCATE_END, max_tokens=8))
    by_ids = opts_stub.Embed(pb.EmbedRequest(token_ids=[pb.TokenIds(ids=end)]))
    np.testing.assert_allclose(vectors(by_text), vectors(by_ids), atol=1e-6)
    assert by_text.usage.prompt_tokens == 8
    cut_ids = opts_stub.Embed(pb.EmbedRequest(token_ids=[pb.TokenIds(ids=full)], truncate=pb.TRUNCATE_END, max_tokens=8))
    assert cut_ids.usage.prompt_tokens == 8
    with pytest.raises(grpc.RpcError) as err:
        opts_stub.Embed(pb.EmbedRequest(texts=[long], max_tokens=8))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "over the request's max_tokens 8" in err.value.details()

