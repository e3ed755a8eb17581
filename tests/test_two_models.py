"""One `pollen serve` holding an embedder (the bundled all-MiniLM-L6-v2) and a reranker (a tiny
random BERT cross-encoder): each answers its own task correctly, against sentence-transformers'
SentenceTransformer and CrossEncoder on the same checkpoints; Info and /v1/models list both with
their tasks; a request names its model or gets the first of its task; a wrong name or a wrong
task is refused naming the models that can serve it, and the next request is answered."""
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
from tests.test_rerank_api import DOCS, QUERY, make_cross_encoder

TEXTS = ["a bee on a flower", "the stock market closed higher", "honey is made from nectar"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reranker = make_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder"))
    srv = ServerProcess("--model", default_model_path(), "--model", reranker,
                        "--served-model-name", "minilm", "--served-model-name", "ranker").start()
    srv.reranker = reranker
    yield srv
    assert srv.terminate() == 0


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{server.http_listen}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def embed(stub, **fields) -> np.ndarray:
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS, normalize=True, **fields), timeout=30)
    return np.frombuffer(reply.embeddings, np.float32).reshape(reply.rows, reply.dims), reply.model


def test_both_models_answer_their_task_as_their_references(server):
    from sentence_transformers import CrossEncoder, SentenceTransformer

    vectors = SentenceTransformer(default_model_path(), device="cpu").encode(TEXTS, normalize_embeddings=True)
    scores = CrossEncoder(server.reranker, device="cpu").predict([(QUERY, d) for d in DOCS])
    with grpc.insecure_channel(server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        for fields in ({}, {"model": "minilm"}):  # no name: the first embedder
            got, model = embed(stub, **fields)
            assert model == "minilm"
            assert np.abs(got - vectors).max() <= 1e-4
        for fields in ({}, {"model": "ranker"}):  # no name: the first reranker
            reply = stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCS, **fields), timeout=30)
            assert reply.model == "ranker"
            got = np.array([r.score for r in sorted(reply.results, key=lambda r: r.index)])
            assert np.abs(got - scores).max() <= 1e-4
    status, body = post(server, "/v1/embeddings", {"model": "text-embedding-3-small", "input": TEXTS})
    assert status == 200 and body["model"] == "minilm"  # OpenAI clients send names we cannot know
    assert np.abs(np.array([d["embedding"] for d in body["data"]]) - vectors).max() <= 1e-4
    status, body = post(server, "/v1/rerank", {"model": "ranker", "query": QUERY, "documents": DOCS})
    assert status == 200 and body["results"][0]["index"] == int(np.argmax(scores))


def test_info_and_models_list_every_model_with_its_task(server):
    with grpc.insecure_channel(server.listen) as channel:
        info = pb_grpc.EmbedderStub(channel).Info(pb.InfoRequest(), timeout=30)
    assert [(m.name, m.task, m.dimensions) for m in info.models] == [("minilm", "embed", 384), ("ranker", "rerank", 1)]
    assert info.model == "minilm" and info.task == "embed"  # the first model, in the older fields
    with urllib.request.urlopen(f"http://{server.http_listen}/v1/models", timeout=30) as reply:
        listed = json.loads(reply.read())["data"]
    assert [(m["id"], m["task"], m["dimensions"]) for m in listed] == [("minilm", "embed", 384),
                                                                        ("ranker", "rerank", 1)]


@pytest.mark.parametrize("call, words", [
    (lambda stub: stub.Embed(pb.EmbedRequest(texts=["x"], model="ranker"), timeout=30),
     ("ranker is a reranker", "the models that can: minilm")),
    (lambda stub: stub.Rerank(pb.RerankRequest(query="q", documents=["d"], model="minilm"), timeout=30),
     ("minilm is an embedding model", "the models that can: ranker")),
    (lambda stub: stub.Embed(pb.EmbedRequest(texts=["x"], model="nope"), timeout=30),
     ("'nope' is not served", "minilm (embed), ranker (rerank)")),
])
def test_a_wrong_model_or_task_is_refused_naming_the_models_that_can(server, call, words):
    with grpc.insecure_channel(server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            call(stub)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(w in err.value.details() for w in words), err.value.details()
        assert embed(stub)[1] == "minilm"  # and the next request is answered
    status, body = post(server, "/v1/rerank", {"model": "minilm", "query": "q", "documents": ["d"]})
    assert status == 400 and "the models that can: ranker" in body["error"]["message"]


def test_tokenize_reads_with_the_named_model_s_tokenizer(server):
    with grpc.insecure_channel(server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        for model in ("", "minilm", "ranker"):
            reply = stub.Tokenize(pb.TokenizeRequest(texts=["honey bees"], model=model), timeout=30)
            assert reply.counts[0] == 4  # [CLS] honey bees [SEP]: both are MiniLM's tokenizer


def test_flags_that_change_one_checkpoint_are_refused_beside_another():
    from pollen.server.config import ServeConfig

    with pytest.raises(ValueError, match="--pooling change one checkpoint"):
        ServeConfig.from_args(["--model", "a", "--model", "b", "--pooling", "cls"], {})
    with pytest.raises(ValueError, match="gives 3 names for 2"):
        ServeConfig.from_args(["--model", "a", "--model", "b", "--served-model-name", "x,y,z"], {})
    cfg = ServeConfig.from_args([], {"POLLEN_MODEL": "a,b", "POLLEN_SERVED_MODEL_NAME": "x"})
    assert cfg.model_paths() == ["a", "b"] and cfg.served_names() == ["x", None]


def test_metrics_count_requests_by_task(server):
    def scrape() -> str:
        with urllib.request.urlopen(f"http://{server.http_listen}/metrics", timeout=30) as reply:
            return reply.read().decode()

    def count(text: str, outcome: str, task: str) -> float:
        line = f'pollen_requests_total{{door="grpc",outcome="{outcome}",task="{task}"}} '
        return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)

    import time

    before = scrape()
    with grpc.insecure_channel(server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        stub.Rerank(pb.RerankRequest(query=QUERY, documents=DOCS), timeout=30)
        with pytest.raises(grpc.RpcError):
            stub.Rerank(pb.RerankRequest(query=QUERY, documents=[]), timeout=30)
        embed(stub)
    time.sleep(1.5)  # each frontend writes its counts out at most half a second later (server/observe/metrics.py)
    after = scrape()
    assert count(after, "ok", "rerank") - count(before, "ok", "rerank") == 1
    assert count(after, "INVALID_ARGUMENT", "rerank") - count(before, "INVALID_ARGUMENT", "rerank") == 1
    assert count(after, "ok", "embed") - count(before, "ok", "embed") == 1


def test_each_model_s_memory_is_exported(server):
    with urllib.request.urlopen(f"http://{server.http_listen}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    memory = {line.split('model="')[1].split('"')[0]: float(line.split()[-1])
              for line in text.splitlines() if line.startswith("pollen_model_memory_bytes{")}
    assert set(memory) == {"minilm", "ranker"}
    assert memory["minilm"] > 80e6 > memory["ranker"] > 1e6  # MiniLM's 90 MB of float32 weights; the tiny one's
