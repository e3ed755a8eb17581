"""The Python client and `pollen embed` / `pollen rerank` against one server of three tiny models,
a reranker first and a SPLADE model as its first embedder: every call names its model and
reports the model that answered, values against each model's reference (sentence-transformers,
CrossEncoder, the transformers SPLADE recipe); a plain dense request to the SPLADE model is
refused naming --sparse, never answered with no rows; a short answer is an error. (Classify's
model: tests/test_classify.py.)"""
from __future__ import annotations

import asyncio
import json
import subprocess

import grpc
import numpy as np
import pytest

from pollen.client import AsyncClient, Client, EmbedError, decode
from pollen.v1 import embedder_pb2 as pb
from tests.conftest import POLLEN, ServerProcess
from tests.st_models import copy_bert_tokenizer, randomize, save_st
from tests.test_cli_embed import pollen_embed
from tests.test_rerank_api import DOCS, QUERY, make_cross_encoder
from tests.test_splade import assert_same, make_splade
from tests.test_splade import reference as splade_reference

TEXTS = ["a bee on a flower", "the stock market closed higher", "honey is made from nectar"]


def make_embedder(path):
    """A tiny random BERT under sentence-transformers' mean pooling; returns its SentenceTransformer."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(11)
    model = BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=128)).eval()
    randomize(model)
    model.save_pretrained(str(path / "hf"))
    copy_bert_tokenizer(path / "hf")
    return save_st(path / "st", path / "hf", "mean")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    embedder = tmp_path_factory.mktemp("tiny-embedder")
    return {"ranker": make_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder")),
            "splade": make_splade(tmp_path_factory.mktemp("tiny-splade"), "bert"),
            "dense": str(embedder / "st"), "dense_reference": make_embedder(embedder)}


@pytest.fixture(scope="module")
def server(models):
    names = ("ranker", "splade", "dense")
    # --tokie off: tokie's start-up probe of each tokenizer is most of a tiny model's start, and
    # what these tests ask does not depend on which library tokenizes.
    srv = ServerProcess(*[a for name in names for a in ("--model", models[name])],
                        "--served-model-name", ",".join(names), "--tokie", "off").start()
    yield srv
    assert srv.terminate() == 0


def dense_reference(models, texts=TEXTS) -> np.ndarray:
    return models["dense_reference"].encode(texts, normalize_embeddings=True, convert_to_numpy=True)


def test_every_client_call_names_its_model_and_reports_the_one_that_answered(server, models):
    from sentence_transformers import CrossEncoder

    with Client(server.listen) as client:
        vectors = client.embed(TEXTS, model="dense")
        tokens = client.embed_tokens(TEXTS, model="dense", normalize=False)
        sparse = client.embed_sparse(TEXTS, model="splade")
        streamed = list(client.embed_stream([TEXTS[0], TEXTS[1:]], model="dense"))
        ranked = client.rerank(QUERY, DOCS, model="ranker")
    assert vectors.model == tokens.model == "dense" and sparse.model == "splade" and ranked.model == "ranker"
    assert [rows.model for rows in streamed] == ["dense", "dense"]
    want = dense_reference(models)
    assert np.abs(vectors - want).max() <= 1e-5
    assert np.abs(np.concatenate([streamed[0][None], streamed[1]]) - want).max() <= 1e-5
    hidden = models["dense_reference"].encode(TEXTS, output_value="token_embeddings", convert_to_numpy=True)
    assert [len(t) for t in tokens] == [len(h) for h in hidden]
    assert max(np.abs(t - h.numpy()).max() for t, h in zip(tokens, hidden)) <= 1e-5
    for (ids, weights), theirs in zip(sparse, splade_reference(models["splade"], TEXTS)):
        assert_same(dict(zip(ids.tolist(), weights.tolist())), theirs)
    scores = CrossEncoder(models["ranker"], device="cpu").predict([(QUERY, d) for d in DOCS])
    assert [i for i, _ in ranked] == list(np.argsort(-scores, kind="stable"))
    assert np.abs(np.array([s for _, s in sorted(ranked)]) - scores).max() <= 1e-4

    async def asynchronous():
        async with AsyncClient(server.listen) as client:
            return (await client.embed(TEXTS, model="dense"), await client.embed_sparse(TEXTS[:1], model="splade"),
                    await client.rerank(QUERY, DOCS, top_n=1))
    vectors, sparse, ranked = asyncio.run(asynchronous())
    assert (vectors.model, sparse.model, ranked.model) == ("dense", "splade", "ranker")
    assert np.abs(vectors - want).max() <= 1e-5 and ranked[0][0] == int(np.argmax(scores))


def test_a_plain_embed_to_a_sparse_model_is_refused_not_answered_empty(server, models):
    """The first embedder here is SPLADE: a request for dense vectors names what it answers instead."""
    with Client(server.listen) as client:
        with pytest.raises(EmbedError) as caught:
            client.embed(TEXTS)
        with pytest.raises(EmbedError) as streamed:
            list(client.embed_stream(TEXTS))
        plain = client.embed_sparse(TEXTS)  # no name: the first embedder, which answers sparse vectors
    for err in (caught.value, streamed.value):
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "OUTPUT_DENSE is not served for splade" in err.message, err.message
    assert plain.model == "splade" and len(plain) == len(TEXTS)


def test_an_answer_with_fewer_rows_than_texts_is_an_error():
    """decode's check, on the answer a dense request to a sparse model gets from a server that
    does not refuse it (pollen's before the client named its outputs): no rows for two texts."""
    answer = pb.EmbedResponse(model="splade", sparse_counts=[3, 2], encoding=pb.ENCODING_FLOAT32)
    with pytest.raises(EmbedError) as caught:
        decode(answer, 2)
    assert caught.value.code == grpc.StatusCode.INTERNAL
    assert caught.value.message == "model splade answered 0 dense vectors for 2 texts"
    whole = pb.EmbedResponse(model="m", rows=1, dims=2, embeddings=np.float32([3, 4]).tobytes())
    assert decode(whole, 1).model == "m" and decode(whole, 1).tolist() == [[3, 4]]


def test_the_commands_take_model_and_print_the_one_that_answered(server, models):
    plain = pollen_embed(*TEXTS, "--server", server.listen)
    assert plain.returncode == 1 and plain.stdout == ""
    assert "dense output is not served for splade" in plain.stderr and "--sparse" in plain.stderr, plain.stderr
    sparse = pollen_embed(*TEXTS, "--sparse", "--server", server.listen)
    assert sparse.returncode == 0, sparse.stderr
    doc = json.loads(sparse.stdout)
    assert doc["model"] == "splade"
    for row, theirs in zip(doc["sparse_embeddings"], splade_reference(models["splade"], TEXTS)):
        assert_same(dict(zip(row["indices"], row["values"])), theirs)
    dense = pollen_embed(*TEXTS, "--model", "dense", "--server", server.listen)
    assert dense.returncode == 0, dense.stderr
    doc = json.loads(dense.stdout)
    assert doc["model"] == "dense" and np.abs(np.array(doc["embeddings"]) - dense_reference(models)).max() <= 1e-5
    tokens = pollen_embed(TEXTS[0], "--tokens", "--model", "dense", "--server", server.listen)
    assert tokens.returncode == 0 and json.loads(tokens.stdout)["model"] == "dense", tokens.stderr
    wrong = pollen_embed(TEXTS[0], "--model", "ranker", "--server", server.listen)
    assert wrong.returncode == 1 and "ranker is a reranker" in wrong.stderr, wrong.stderr
    ranked = subprocess.run([POLLEN, "rerank", QUERY, *DOCS, "--model", "ranker", "--top-n", "2", "--server",
                             server.listen], capture_output=True, text=True, timeout=120)
    assert ranked.returncode == 0, ranked.stderr
    answer = json.loads(ranked.stdout)
    assert answer["model"] == "ranker" and len(answer["results"]) == 2
