"""LangChain's OpenAIEmbeddings against a real `pollen serve`, offline, unchanged: with its
defaults it sends tiktoken's cl100k token ids, which pollen refuses with a 400 naming the client
setting that sends text (never a 200 with wrong vectors); with check_embedding_ctx_length=False it
sends texts, 1,000 in one call (LangChain's default chunk, over --max-texts-per-request: the server
sends it as several records), and gets pollen's own vectors. --openai-token-ids takes the model's
own ids."""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import re
import urllib.request

import grpc
import numpy as np
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
TEXTS = [f"document {i}: bees carry pollen between {i % 7 + 2} flowers" for i in range(1000)]


@pytest.fixture(scope="module")
def tiktoken_cache(tmp_path_factory):
    """tiktoken's cache holding cl100k_base, from the bpe-openai package: tiktoken reads a file
    named by the sha1 of the URL it would fetch (and checks the file's own sha256)."""
    folder = tmp_path_factory.mktemp("tiktoken")
    package = importlib.util.find_spec("bpe_openai").submodule_search_locations[0]
    data = gzip.open(os.path.join(package, "data", "cl100k_base.tiktoken.gz")).read()
    (folder / hashlib.sha1(CL100K_URL.encode()).hexdigest()).write_bytes(data)
    return str(folder)


@pytest.fixture
def embeddings(tiktoken_cache, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", tiktoken_cache)

    def make(server, **options):
        from langchain_openai import OpenAIEmbeddings

        return OpenAIEmbeddings(model="text-embedding-3-small", base_url=f"http://{server.http_listen}/v1",
                                api_key="unused", max_retries=0, **options)
    return make


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().start()
    yield srv
    assert srv.terminate() == 0


def pollen_vectors(server, texts) -> np.ndarray:
    with grpc.insecure_channel(server.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        rows = []
        for i in range(0, len(texts), 500):
            reply = stub.Embed(pb.EmbedRequest(texts=texts[i:i + 500], normalize=True), timeout=60)
            rows.append(np.frombuffer(reply.embeddings, np.float32).reshape(reply.rows, reply.dims))
    return np.concatenate(rows)


def http_embed_requests(server) -> float:
    with urllib.request.urlopen(f"http://{server.http_listen}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    match = re.search(r'^pollen_requests_total\{(?=[^}]*door="http")(?=[^}]*outcome="ok")(?=[^}]*task="embed")'
                      r'[^}]*\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_defaults_fail_loudly_naming_the_setting(server, embeddings):
    import openai

    client = embeddings(server)
    for call in (lambda: client.embed_documents(TEXTS[:3]), lambda: client.embed_query("what do bees carry")):
        with pytest.raises(openai.BadRequestError) as failure:
            call()
        assert failure.value.status_code == 400
        assert "check_embedding_ctx_length=False" in str(failure.value) and "token ids" in str(failure.value)


def test_text_input_gets_pollens_vectors_for_1000_texts_in_one_call(server, embeddings):
    client = embeddings(server, check_embedding_ctx_length=False)
    before = http_embed_requests(server)
    got = np.array(client.embed_documents(TEXTS))
    assert http_embed_requests(server) - before == 1  # one request of 1,000 texts
    assert got.shape == (1000, 384)
    assert np.abs(got - pollen_vectors(server, TEXTS)).max() <= 1e-6
    query = np.array(client.embed_query(TEXTS[3]))
    assert np.abs(query - got[3]).max() <= 1e-6


def post(server, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{server.http_listen}/v1/embeddings", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_openai_limit_is_2048_inputs(server):
    texts = [f"t{i} honey" for i in range(2048)]
    code, answer = post(server, {"input": texts, "model": "m"})
    assert code == 200 and [d["index"] for d in answer["data"]] == list(range(2048))
    want = pollen_vectors(server, texts[1530:1540])
    assert np.abs(np.array([d["embedding"] for d in answer["data"][1530:1540]]) - want).max() <= 1e-6
    code, answer = post(server, {"input": [*texts, "one more"], "model": "m"})
    assert code == 400 and "2049 inputs" in answer["error"]["message"] and "2048" in answer["error"]["message"]


def test_openai_token_ids_flag_takes_the_models_ids():
    srv = ServerProcess("--openai-token-ids", "on").start()
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            ids = list(pb_grpc.EmbedderStub(channel).Tokenize(pb.TokenizeRequest(texts=TEXTS[:1]), timeout=30)
                       .tokens[0].ids)
        code, answer = post(srv, {"input": [ids], "model": "m"})
        assert code == 200
        assert np.abs(np.array(answer["data"][0]["embedding"]) - pollen_vectors(srv, TEXTS[:1])[0]).max() <= 1e-6
    finally:
        assert srv.terminate() == 0
