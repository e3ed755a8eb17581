"""TEI's clients, unchanged, against one server of three tiny models, a reranker first, then an
embedder and a classifier (server/http_api/tei.py, server/grpc_api/tei.py): POST / follows the body's
shape (huggingface_hub's InferenceClient on the server's base URL embeds, compares and
classifies); every TEI route is served for one model under /models/<name>/ (tei-client's
HttpClient and huggingface_hub with that base URL, /info describing that model); tei.v1 calls
name one model with `pollen-model` metadata (tei-client's own stubs). Values against
sentence-transformers, CrossEncoder and HF's softmax of the classifier's logits."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from tests.conftest import ServerProcess
from tests.test_classify import LABELS, hf_logits, make_classifier
from tests.test_client_models import make_embedder
from tests.test_rerank_api import DOCS, QUERY, make_cross_encoder
from tests.test_tei_http import call, refused

tei_client = pytest.importorskip("tei_client")
from tei_client.stubs import tei_pb2 as tei  # noqa: E402
from tei_client.stubs import tei_pb2_grpc as tei_grpc  # noqa: E402

TEXTS = ["Bees make honey from nectar.", "A man is playing a guitar.", "stock prices fell"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from sentence_transformers import CrossEncoder

    embedder = tmp_path_factory.mktemp("tiny-embedder")
    made = {"ranker": make_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder")),
            "embedding": make_embedder(embedder), "dense": str(embedder / "st"),
            "classes": make_classifier(tmp_path_factory.mktemp("tiny-classifier"))}
    made["scores"] = CrossEncoder(made["ranker"], device="cpu").predict([(QUERY, d) for d in DOCS])
    logits = hf_logits(made["classes"], TEXTS)
    made["softmax"] = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return made


@pytest.fixture(scope="module")
def server(models):
    # --tokie off: tokie's start-up probe of each tokenizer is most of a tiny model's start, and
    # what these tests ask does not depend on which library tokenizes.
    srv = ServerProcess("--model", models["ranker"], "--model", models["dense"], "--model", models["classes"],
                        "--served-model-name", "ranker,dense,classes", "--tokie", "off").start()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture
def online(monkeypatch):
    """conftest sets HF_HUB_OFFLINE for the model loads, which would block huggingface_hub's
    requests even to a local server: its client runs as a user's, online."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def vectors(models, texts) -> np.ndarray:
    return models["embedding"].encode(texts, normalize_embeddings=True, convert_to_numpy=True)


def assert_labels(predictions, row: np.ndarray) -> None:
    """(label, score) pairs, best first, equal to one text's softmax over LABELS."""
    assert [label for label, _ in predictions] == [LABELS[i] for i in np.argsort(-row, kind="stable")]
    assert max(abs(score - row[LABELS.index(label)]) for label, score in predictions) <= 1e-4


def test_post_root_follows_the_body_s_shape(server, models, online):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=f"http://{server.http_listen}")
    got = client.feature_extraction(TEXTS[0])  # no query, no parameters: the first model that embeds
    assert got.shape == (1, 32) and np.abs(got - vectors(models, TEXTS[:1])).max() <= 1e-5
    want = vectors(models, TEXTS).astype(np.float64)
    similar = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])  # an object `inputs`
    assert np.abs(np.array(similar) - want[1:] @ want[0]).max() <= 1e-5
    top = client.text_classification(TEXTS[0])  # `parameters`: the classifier
    assert top.label == LABELS[int(np.argmax(models["softmax"][0]))]
    assert abs(top.score - models["softmax"][0].max()) <= 1e-4
    code, ranked = call(server, "/", {"query": QUERY, "texts": DOCS})  # `query`: the reranker
    assert code == 200 and [r["index"] for r in ranked] == list(np.argsort(-models["scores"], kind="stable"))


def test_each_model_s_routes_under_its_name(server, models, online):
    from huggingface_hub import InferenceClient

    base = f"http://{server.http_listen}"
    assert tei_client.HttpClient(base).info().server_model_id == "ranker"  # /info: the first model
    classes = tei_client.HttpClient(f"{base}/models/classes")
    assert classes.health()
    info = classes.info()
    assert info.server_model_id == "classes" and info.server_model_type == tei_client.ModelType.Classifier
    for result, row in zip(classes.classify(TEXTS), models["softmax"], strict=True):
        assert_labels([(s.label, s.score) for s in result.scores], row)
    dense = tei_client.HttpClient(f"{base}/models/dense")
    assert dense.info().server_model_type == tei_client.ModelType.Embedding
    assert np.abs(np.array(dense.embed(TEXTS)) - vectors(models, TEXTS)).max() <= 1e-5
    ranked = tei_client.HttpClient(f"{base}/models/ranker").rerank(QUERY, DOCS)
    assert [r.index for r in ranked.ranks] == list(np.argsort(-models["scores"], kind="stable"))
    assert np.abs(np.array([r.score for r in sorted(ranked.ranks, key=lambda r: r.index)])
                  - models["scores"]).max() <= 1e-4
    # huggingface_hub posts to the URL itself: /models/<name> is that model's own default route.
    top = InferenceClient(base_url=f"{base}/models/classes").text_classification(TEXTS[1])
    assert top.label == LABELS[int(np.argmax(models["softmax"][1]))]
    got = InferenceClient(base_url=f"{base}/models/dense").feature_extraction(TEXTS[1])
    assert np.abs(got - vectors(models, TEXTS[1:2])).max() <= 1e-5
    refused(server, "/models/dense/predict", {"inputs": "x"}, 424, "backend", "dense is an embedding model")
    code, answer = call(server, "/models/nope/info")
    assert code == 404 and "the models served: ranker, dense, classes" in answer["error"]["message"]


def test_tei_grpc_calls_name_their_model_in_metadata(server, models):
    def named(name: str) -> tuple:
        return (("pollen-model", name),)

    with grpc.insecure_channel(server.listen) as channel:
        info = tei_grpc.InfoStub(channel)
        assert info.Info(tei.InfoRequest(), timeout=30).model_type == tei.MODEL_TYPE_RERANKER  # the first model
        answer = info.Info(tei.InfoRequest(), metadata=named("classes"), timeout=30)
        assert answer.model_id == "classes" and answer.model_type == tei.MODEL_TYPE_CLASSIFIER
        predicted = tei_grpc.PredictStub(channel).Predict(tei.PredictRequest(inputs=TEXTS[2]),
                                                          metadata=named("classes"), timeout=30)
        assert_labels([(p.label, p.score) for p in predicted.predictions], models["softmax"][2])
        embed = tei_grpc.EmbedStub(channel)
        got = embed.Embed(tei.EmbedRequest(inputs=TEXTS[0], normalize=True), metadata=named("dense"), timeout=30)
        assert np.abs(np.array(got.embeddings) - vectors(models, TEXTS[:1])[0]).max() <= 1e-5
        for name, code, words in (("classes", grpc.StatusCode.FAILED_PRECONDITION, "pollen-model classes is a "
                                   "classifier"), ("nope", grpc.StatusCode.INVALID_ARGUMENT, "'nope' is not served")):
            with pytest.raises(grpc.RpcError) as err:
                embed.Embed(tei.EmbedRequest(inputs="x"), metadata=named(name), timeout=30)
            assert err.value.code() == code and words in err.value.details(), err.value.details()
