"""TEI's HTTP API (server/http_api/tei.py) through a real `pollen serve` of an embedder (the bundled
all-MiniLM-L6-v2), a tiny reranker and a tiny classifier, requests shaped as TEI's documentation
shows them: every route's answer against pollen's own pollen.v1 answer for the same texts (or
sentence-transformers and the tokenizer), each route's refusal in TEI's error body and status,
and huggingface_hub's InferenceClient(base_url=...) unchanged."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from pollen.common.model_spec import default_model_path
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.test_classify import LABELS, make_classifier
from tests.test_rerank_api import DOCS, QUERY, make_cross_encoder

TEXTS = ["What is Deep Learning?", "Bees make honey from nectar.", "東京 🙂 is a city", "stock prices fell"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {"ranker": make_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder")),
            "classifier": make_classifier(tmp_path_factory.mktemp("tiny-classifier"))}


@pytest.fixture(scope="module")
def server(paths):
    srv = ServerProcess("--model", default_model_path(), "--model", paths["ranker"], "--model", paths["classifier"],
                        "--served-model-name", "minilm,ranker,classes").start()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.listen) as channel:
        yield pb_grpc.EmbedderStub(channel)


def call(server, path: str, body=None, method: str | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{server.http_listen}{path}", data,
                                     {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            raw = reply.read()
            return reply.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def refused(server, path: str, body, status: int, error_type: str, fragment: str = "") -> None:
    code, answer = call(server, path, body)
    assert code == status, answer
    assert set(answer) == {"error", "error_type"} and answer["error_type"] == error_type, answer
    assert fragment in answer["error"], answer


def pollen_vectors(stub, texts, **fields) -> np.ndarray:
    reply = stub.Embed(pb.EmbedRequest(texts=texts, model="minilm", **fields), timeout=30)
    return np.frombuffer(reply.embeddings, np.float32).reshape(reply.rows, reply.dims)


def test_info_describes_the_first_model_as_tei(server):
    code, info = call(server, "/info")
    assert code == 200
    for field in ("model_id", "model_dtype", "model_type", "max_concurrent_requests", "max_input_length",
                  "max_batch_tokens", "max_client_batch_size", "auto_truncate", "tokenization_workers", "version"):
        assert field in info, field
    assert info["model_id"] == info["served_model_name"] == "minilm"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == 512
    assert info["auto_truncate"] is False and info["model_dtype"] == "float32"


def test_embed_equals_pollen_embed(server, stub):
    code, got = call(server, "/embed", {"inputs": TEXTS})
    assert code == 200
    assert np.abs(np.array(got) - pollen_vectors(stub, TEXTS, normalize=True)).max() <= 1e-6
    code, raw = call(server, "/embed", {"inputs": TEXTS[0], "normalize": False})
    assert code == 200 and len(raw) == 1
    assert np.abs(np.array(raw) - pollen_vectors(stub, TEXTS[:1])).max() <= 1e-6
    ids = list(stub.Tokenize(pb.TokenizeRequest(texts=TEXTS[:1], model="minilm"), timeout=30).tokens[0].ids)
    code, from_ids = call(server, "/embed", {"inputs": ids})  # TEI takes the model's own ids too
    assert code == 200 and np.abs(np.array(from_ids) - np.array(got[:1])).max() <= 1e-6


def test_embed_truncate_and_direction(server, stub):
    long = " ".join(f"word{i}" for i in range(400))
    refused(server, "/embed", {"inputs": long, "truncate": False}, 413, "validation", "set truncate to true")
    for direction, truncate in (("right", pb.TRUNCATE_END), ("left", pb.TRUNCATE_START)):
        code, got = call(server, "/embed", {"inputs": [long], "truncate": True, "truncation_direction": direction})
        assert code == 200
        want = pollen_vectors(stub, [long], normalize=True, truncate=truncate)
        assert np.abs(np.array(got) - want).max() <= 1e-6


def test_embed_refusals(server):
    refused(server, "/embed", {"inputs": []}, 400, "empty")
    refused(server, "/embed", {"inputs": ["a"] * 513}, 413, "validation", "513 inputs")
    refused(server, "/embed", {"inputs": "a", "normalize": "yes"}, 422, "validation", "normalize")
    refused(server, "/embed", {"inputs": "a", "prompt_name": "nope"}, 413, "validation", "prompt_name")
    refused(server, "/embed", {"inputs": 7}, 422, "validation", "inputs")


def test_similarity_is_the_cosine_of_pollen_vectors(server, stub):
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}
    code, got = call(server, "/similarity", body)
    vectors = pollen_vectors(stub, TEXTS, normalize=True).astype(np.float64)
    assert code == 200 and np.abs(np.array(got) - vectors[1:] @ vectors[0]).max() <= 1e-5
    assert call(server, "/", body) == (code, got)  # POST / to an embedder: an object `inputs` is a similarity
    refused(server, "/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "empty")


def test_default_route_of_an_embedder_embeds(server):
    assert call(server, "/", {"inputs": TEXTS}) == call(server, "/embed", {"inputs": TEXTS})
    assert call(server, "/", None, "GET") == (200, None)  # TEI's GET /: health


def test_rerank_equals_pollen_rerank(server, stub):
    code, got = call(server, "/rerank", {"query": QUERY, "texts": DOCS, "return_text": True})
    want = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCS, model="ranker"), timeout=30)
    assert code == 200 and [r["index"] for r in got] == [r.index for r in want.results]
    assert np.allclose([r["score"] for r in got], [r.score for r in want.results], atol=1e-6)
    assert [r["text"] for r in got] == [DOCS[r["index"]] for r in got]
    code, raw = call(server, "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True})
    assert code == 200 and "text" not in raw[0] and min(r["score"] for r in raw) < 0  # logits, not sigmoids
    refused(server, "/rerank", {"query": QUERY, "texts": []}, 400, "empty", "`texts` cannot be empty")
    refused(server, "/rerank", {"query": QUERY}, 422, "validation", "texts")


def test_predict_single_pair_and_batch(server, stub):
    def labels(texts, pairs=()):
        reply = stub.Classify(pb.ClassifyRequest(texts=texts, text_pairs=pairs, model="classes"), timeout=30)
        return [[(s.label, round(s.score, 5)) for s in r.labels] for r in reply.results]

    def rounded(predictions):
        return [(p["label"], round(p["score"], 5)) for p in predictions]

    code, one = call(server, "/predict", {"inputs": TEXTS[0]})
    assert code == 200 and rounded(one) == labels(TEXTS[:1])[0] and {p["label"] for p in one} == set(LABELS)
    code, pair = call(server, "/predict", {"inputs": [TEXTS[0], TEXTS[1]]})
    assert code == 200 and rounded(pair) == labels(TEXTS[:1], TEXTS[1:2])[0]
    code, batch = call(server, "/predict", {"inputs": [[TEXTS[2]], [TEXTS[0], TEXTS[1]], [TEXTS[3]]]})
    assert code == 200 and [rounded(b) for b in batch] == [labels([TEXTS[2]])[0], rounded(pair),
                                                           labels([TEXTS[3]])[0]]
    refused(server, "/predict", {"inputs": []}, 400, "empty")
    refused(server, "/predict", {"inputs": [["a", "b", "c"]]}, 422, "validation", "inputs[0]")


def test_tokenize_gives_utf8_byte_offsets(server):
    text = "héllo 東京 world"
    code, got = call(server, "/tokenize", {"inputs": text})
    assert code == 200 and len(got) == 1
    tokens = got[0]
    assert tokens[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert tokens[-1]["text"] == "[SEP]" and tokens[-1]["special"]
    data = text.encode()
    for token in tokens[1:-1]:
        assert data[token["start"]:token["stop"]].decode() == token["text"]
    assert [t["start"] for t in tokens[1:-1]] == [0, 7, 10, 14]  # é is 2 bytes, 東 and 京 3 each
    code, bare = call(server, "/tokenize", {"inputs": [text, "a"], "add_special_tokens": False})
    assert code == 200 and [t["id"] for t in bare[0]] == [t["id"] for t in tokens[1:-1]] and len(bare) == 2
    refused(server, "/tokenize", {"inputs": []}, 400, "empty")


def test_decode(server):
    assert call(server, "/decode", {"ids": [101, 7592, 2088, 102]}) == (200, ["hello world"])
    assert call(server, "/decode", {"ids": [[101, 7592, 102], [2088]], "skip_special_tokens": False}) == \
        (200, ["[CLS] hello [SEP]", "world"])
    refused(server, "/decode", {"ids": [10 ** 6]}, 422, "tokenizer", "outside the vocabulary")
    refused(server, "/decode", {"ids": []}, 400, "empty")


def test_embed_all_answers_token_vectors_and_refuses_as_tei(server, stub):
    code, answer = call(server, "/embed_all", {"inputs": ["hello world", "bees"], "truncate": True})
    mine = stub.Embed(pb.EmbedRequest(texts=["hello world", "bees"], model="minilm", outputs=[pb.OUTPUT_TOKENS]),
                      timeout=30)
    assert code == 200 and [len(rows) for rows in answer] == list(mine.token_counts)
    want = np.frombuffer(mine.token_embeddings, np.float32).reshape(-1, mine.dims)
    assert np.abs(np.array([row for rows in answer for row in rows], np.float32) - want).max() <= 1e-5
    refused(server, "/embed_all", {"inputs": []}, 400, "empty")
    refused(server, "/embed_all", {"inputs": {"a": 1}}, 422, "validation")
    refused(server, "/embed_all", {"inputs": " ".join(["word"] * 600), "truncate": False}, 413, "validation")


def test_embed_sparse_without_a_sparse_model_is_424(server):
    refused(server, "/embed_sparse", {"inputs": "a"}, 424, "backend", "SPLADE")


@pytest.fixture(scope="module")
def classifier_only(paths):
    srv = ServerProcess("--model", paths["classifier"], "--served-model-name", "classes").start()
    yield srv
    assert srv.terminate() == 0


def test_server_without_the_task_answers_424_and_default_route_predicts(classifier_only):
    refused(classifier_only, "/embed", {"inputs": "a"}, 424, "backend", "not an embedding model")
    refused(classifier_only, "/rerank", {"query": "a", "texts": ["b"]}, 424, "backend", "not a re-ranker")
    code, info = call(classifier_only, "/info")
    assert code == 200 and info["model_type"] == {"classifier": {
        "id2label": {str(i): n for i, n in enumerate(LABELS)}, "label2id": {n: i for i, n in enumerate(LABELS)}}}
    assert call(classifier_only, "/", {"inputs": TEXTS[0]}) == call(classifier_only, "/predict", {"inputs": TEXTS[0]})


def test_huggingface_hub_inference_client(server, stub, classifier_only, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    # conftest sets HF_HUB_OFFLINE for the model loads, and huggingface_hub's offline mode blocks
    # every request, even to a local server: the client runs as a user's, online.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    client = InferenceClient(base_url=f"http://{server.http_listen}")
    got = client.feature_extraction(TEXTS[1])
    assert got.shape == (1, 384) and np.abs(got - pollen_vectors(stub, TEXTS[1:2], normalize=True)).max() <= 1e-6
    cut = client.feature_extraction(" ".join(["bee"] * 400), truncate=True, normalize=False)
    assert cut.shape == (1, 384) and abs(np.linalg.norm(cut) - 1) > 1e-3
    scores = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    vectors = pollen_vectors(stub, TEXTS, normalize=True).astype(np.float64)
    assert np.abs(np.array(scores) - vectors[1:] @ vectors[0]).max() <= 1e-5
    top = InferenceClient(base_url=f"http://{classifier_only.http_listen}").text_classification(TEXTS[0])
    code, want = call(classifier_only, "/predict", {"inputs": TEXTS[0]})
    # TEI's /predict answers one text with its labels best first; the client keeps the first.
    assert top.label == want[0]["label"] and abs(top.score - want[0]["score"]) <= 1e-6
