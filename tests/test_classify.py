"""Classify through a real `pollen serve` of an embedder and a tiny random
BertForSequenceClassification with three named labels (the real MiniLM tokenizer): label scores
against sentence-transformers' CrossEncoder (pairs) and HF's softmax of the logits (texts), the
HTTP /v1/classify route, pollen's client, and the refusals."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from pollen.common.model_spec import default_model_path
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.st_models import copy_bert_tokenizer

LABELS = ("contradiction", "entailment", "neutral")
TEXTS = ["A man is playing a guitar.", "Bees make honey from nectar.", "東京 🙂 is a city", "stock prices fell"]
PAIRS = ["Someone plays music.", "Honey comes from bees.", "Tokyo is large.", "The market went up."]


def make_classifier(path) -> str:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(5)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, num_labels=3,
                        id2label=dict(enumerate(LABELS)), label2id={name: i for i, name in enumerate(LABELS)})
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():  # a sharper head than the init's, so the labels' scores differ clearly
        model.classifier.weight.mul_(20)
    model.save_pretrained(str(path))
    copy_bert_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_classifier(tmp_path_factory.mktemp("tiny-classifier"))
    srv = ServerProcess("--model", default_model_path(), "--model", path,
                        "--served-model-name", "minilm,tiny-classify").start()
    srv.path = path
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.listen) as channel:
        yield pb_grpc.EmbedderStub(channel)


def hf_logits(path: str, texts: list[str], pairs: list[str] | None = None) -> np.ndarray:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(path).eval()
    batch = tokenizer(texts, pairs, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.double().numpy()


def scores_of(reply: pb.ClassifyResponse) -> np.ndarray:
    """The answer's scores as rows in the labels' order, checked to be sorted best first."""
    out = np.zeros((len(reply.results), len(LABELS)))
    for i, result in enumerate(reply.results):
        assert result.index == i
        values = [s.score for s in result.labels]
        assert values == sorted(values, reverse=True) and sorted(s.label for s in result.labels) == list(LABELS)
        for s in result.labels:
            out[i, LABELS.index(s.label)] = s.score
    return out


def test_pairs_equal_cross_encoder_softmax(server, stub):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(server.path, device="cpu")
    expected = model.predict(list(zip(TEXTS, PAIRS)), apply_softmax=True)
    started = time.perf_counter()
    reply = stub.Classify(pb.ClassifyRequest(id="p", texts=TEXTS, text_pairs=PAIRS), timeout=30)
    wall_us = (time.perf_counter() - started) * 1e6
    np.testing.assert_allclose(scores_of(reply), expected, atol=1e-4)
    # The answer times the frontend's tokenizing beside the worker's figures, within the call.
    assert 0 < reply.timing.tokenize_us and reply.timing.tokenize_us + reply.timing.inference_us < wall_us
    assert reply.id == "p" and reply.model == "tiny-classify" and reply.usage.prompt_tokens > 4 * len(TEXTS)
    assert np.ptp(expected, axis=1).min() > 0.05  # the labels' order is tested, not a tie
    raw = stub.Classify(pb.ClassifyRequest(texts=TEXTS, text_pairs=PAIRS, raw_scores=True), timeout=30)
    np.testing.assert_allclose(scores_of(raw), hf_logits(server.path, TEXTS, PAIRS), atol=1e-4)


def test_texts_equal_hf_softmax_of_the_logits(server, stub):
    logits = hf_logits(server.path, TEXTS)
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    reply = stub.Classify(pb.ClassifyRequest(texts=TEXTS, model="tiny-classify"), timeout=30)
    np.testing.assert_allclose(scores_of(reply), expected, atol=1e-4)
    long = stub.Classify(pb.ClassifyRequest(texts=["honey " * 500]), timeout=30)  # cut to fit by default
    assert len(long.results) == 1 and long.usage.prompt_tokens == 128


def test_info_lists_the_classifier_with_its_labels(stub):
    models = {m.name: m for m in stub.Info(pb.InfoRequest(), timeout=30).models}
    assert models["tiny-classify"].task == "classify" and list(models["tiny-classify"].labels) == list(LABELS)
    assert models["minilm"].task == "embed"


def test_http_classify(server):
    request = urllib.request.Request(f"http://{server.http_listen}/v1/classify",
                                     data=json.dumps({"input": TEXTS[:2], "raw_scores": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        body = json.loads(reply.read())
    logits = hf_logits(server.path, TEXTS[:2])
    assert body["model"] == "tiny-classify" and body["usage"]["prompt_tokens"] > 0 and body["id"]
    for i, item in enumerate(body["data"]):
        assert item["index"] == i
        for entry in item["labels"]:
            assert abs(entry["score"] - logits[i, LABELS.index(entry["label"])]) <= 1e-4


@pytest.mark.parametrize("request_, fragment", [
    (pb.ClassifyRequest(texts=["x"], model="minilm"),
     "model minilm is an embedding model: Classify needs a classifier, and the models that can: tiny-classify"),
    (pb.ClassifyRequest(), "texts is empty"),
    (pb.ClassifyRequest(texts=["fine", ""]), "texts[1] is empty"),
    (pb.ClassifyRequest(texts=["a", "b"], text_pairs=["c"]), "text_pairs has 1 entries for 2 texts"),
    (pb.ClassifyRequest(texts=["a"], text_pairs=[""]), "text_pairs[0] is empty"),
    (pb.ClassifyRequest(texts=["a"], text_pairs=["b " * 300], truncate=pb.TRUNCATE_NONE), "text_pairs[0] has more"),
    (pb.ClassifyRequest(texts=["a " * 300], text_pairs=["b"]), "texts[0] leaves no room for text_pairs[0]"),
    (pb.ClassifyRequest(texts=["a"], max_tokens=1000), "max_tokens 1000 is over the model's limit"),
])
def test_bad_requests_are_refused(stub, request_, fragment):
    with pytest.raises(grpc.RpcError) as err:
        stub.Classify(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details()


def test_embed_and_rerank_refused_by_the_classifier(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Rerank(pb.RerankRequest(query="q", documents=["d"], model="tiny-classify"), timeout=30)
    assert "tiny-classify is a classifier: Rerank needs a reranker" in err.value.details()
    assert len(stub.Embed(pb.EmbedRequest(texts=["still served"]), timeout=30).embeddings) == 4 * 384


def test_client_classify(server):
    import asyncio

    from pollen.client import AsyncClient, Client

    with Client(server.listen) as client:
        results = client.classify(TEXTS, text_pairs=PAIRS)
        named = client.classify(TEXTS, model="tiny-classify")
    assert len(results) == len(TEXTS) and all(list(r) == sorted(r, key=r.get, reverse=True) for r in results)
    assert set(results[0]) == set(LABELS) and abs(sum(results[0].values()) - 1) <= 1e-5
    logits = hf_logits(server.path, TEXTS)
    softmax = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert np.abs(np.array([[row[label] for label in LABELS] for row in named]) - softmax).max() <= 1e-4
    assert results.model == named.model == "tiny-classify"  # the classifier, though the embedder comes first

    async def call():
        async with AsyncClient(server.listen) as client:
            return await client.classify(TEXTS, text_pairs=PAIRS, model="tiny-classify")
    again = asyncio.run(call())
    assert [list(r) for r in again] == [list(r) for r in results] and again.model == "tiny-classify"
