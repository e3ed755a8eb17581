"""Server-wide defaults over both doors: --default-prompt-name, --default-truncate and
--served-model-name, on a copy of all-MiniLM-L6-v2 that declares prompts."""
from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from pollen.server.config import ServeConfig
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import POLLEN, ServerProcess, free_port, vectors
from tests.test_api_options import PROMPTS, dress

NAME = "team-embedder"
LONG = " ".join(["pollen"] * 400)  # over all-MiniLM-L6-v2's 256 tokens


@pytest.fixture(scope="module")
def dressed(tmp_path_factory):
    return dress(tmp_path_factory.mktemp("defaults") / "model")


@pytest.fixture(scope="module")
def served(dressed):
    srv = ServerProcess("--model", str(dressed), "--default-prompt-name", "query", "--served-model-name", NAME,
                        env={"POLLEN_DEFAULT_TRUNCATE": "end"}).start()
    with grpc.insecure_channel(srv.listen) as channel:
        yield srv, pb_grpc.EmbedderStub(channel)
    assert srv.terminate() == 0


def post(server, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://{server.http_listen}{path}", data=data)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_the_served_name_is_reported_everywhere(served):
    server, stub = served
    assert stub.Info(pb.InfoRequest()).model == NAME
    assert post(server, "/v1/models")[1]["data"][0]["id"] == NAME
    status, answer = post(server, "/v1/embeddings", {"input": "hello", "model": "whatever"})
    assert (status, answer["model"]) == (200, NAME)


def test_the_default_prompt_applies_when_a_request_names_none(served):
    server, stub = served
    texts = ["what is pollen", "東京 🙂"]

    def embed(**options):
        return vectors(stub.Embed(pb.EmbedRequest(texts=texts, normalize=True, **options), timeout=60))

    default, query, document = embed(), embed(prompt=PROMPTS["query"]), embed(prompt_name="document")
    np.testing.assert_allclose(default, query, atol=1e-6)
    assert np.abs(default - document).max() > 1e-2  # a named prompt still wins over the default
    _, answer = post(server, "/v1/embeddings", {"input": texts})
    np.testing.assert_allclose(np.array([d["embedding"] for d in answer["data"]]), query, atol=1e-5)
    # Tokenize sees the texts as Embed does: with the default prompt's tokens.
    with_default = stub.Tokenize(pb.TokenizeRequest(texts=["x"])).counts[0]
    assert with_default == stub.Tokenize(pb.TokenizeRequest(texts=["x"], prompt_name="query")).counts[0] > 3


def test_the_default_truncate_applies_when_a_request_leaves_it_unset(served):
    server, stub = served
    unset = stub.Embed(pb.EmbedRequest(texts=[LONG]), timeout=60)
    end = stub.Embed(pb.EmbedRequest(texts=[LONG], truncate=pb.TRUNCATE_END), timeout=60)
    assert unset.usage.prompt_tokens == end.usage.prompt_tokens == 256
    np.testing.assert_array_equal(vectors(unset), vectors(end))
    # Set explicitly (proto3 `optional`), TRUNCATE_NONE is kept: the long text is refused.
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(texts=[LONG], truncate=pb.TRUNCATE_NONE), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "over the model's limit" in \
        refused.value.details()
    assert stub.Tokenize(pb.TokenizeRequest(texts=[LONG])).counts[0] == 256
    status, answer = post(server, "/v1/embeddings", {"input": LONG})
    assert (status, answer["usage"]["prompt_tokens"]) == (200, 256)
    status, answer = post(server, "/v1/embeddings", {"input": LONG, "truncate": "none"})
    assert status == 400 and "over the model's limit" in answer["error"]["message"]


def test_the_python_client_leaves_truncate_to_the_server(served):
    from pollen.client import Client, EmbedError

    server, _ = served
    with Client(server.listen) as client:
        assert client.embed([LONG]).shape == (1, 384)
        with pytest.raises(EmbedError) as refused:
            client.embed([LONG], truncate="none")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_defaults_are_checked_at_start(dressed):
    def serve(*args):
        return subprocess.run([POLLEN, "serve", "--model", str(dressed), "--listen", f"127.0.0.1:{free_port()}",
                               "--http-listen", "", *args], check=False, env=os.environ, capture_output=True, text=True,
                              timeout=120)

    run = serve("--default-prompt-name", "passage")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "--default-prompt-name 'passage' is not one of the model's prompts; known: document, query" in run.stderr
    run = serve("--default-truncate", "middle")
    assert run.returncode == 2 and "--default-truncate must be none, end or start, got 'middle'" in run.stderr


def test_empty_variables_mean_unset():
    cfg = ServeConfig.from_args([], environ={"POLLEN_SERVED_MODEL_NAME": "", "POLLEN_DEFAULT_PROMPT_NAME": "",
                                             "POLLEN_REVISION": ""})
    # Unset: the default model's Hub id, no prompt, no revision, the default truncate.
    assert (cfg.served_model_name, cfg.default_prompt_name, cfg.revision, cfg.default_truncate) == \
        ("sentence-transformers/all-MiniLM-L6-v2", None, None, "none")
