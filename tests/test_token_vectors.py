"""Per-token vectors (outputs OUTPUT_TOKENS, server/tasks/token_vectors.py) through a real server, against
HF transformers' last hidden state of the same tokens (special tokens included) and
sentence-transformers' pooled vector from the same pass; over gRPC, the Python client, the OpenAI
route's `outputs`, TEI's /embed_all and tei.v1 EmbedAll (tei-client); and their bounds and refusals."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from pollen.client import Client
from pollen.common.model_spec import default_model_path
from pollen.server.process.app import response_ring_for
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, cosine_rows, vectors

TEXTS = ["The cat sits outside.", "A man is playing the guitar on a quiet street corner tonight.", "Hi"]
MAX_TOKEN_VECTORS = 120
MAX_TEXTS = 4
HIDDEN = 384


@pytest.fixture(scope="module")
def hf_hidden():
    """HF transformers' last hidden state of each text (the model's own tokenizer, special tokens included)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModel.from_pretrained(default_model_path()).eval()
    out = []
    with torch.inference_mode():
        for text in TEXTS:
            batch = tokenizer(text, return_tensors="pt")
            out.append(model(**batch).last_hidden_state[0].numpy())
    return out


# A response ring whose record carries fewer rows (51) than a 100-token text has tokens, and still
# the MAX_TEXTS + 1 rows a batch needs: the per-text bound is crossed below the model's limit.
SMALL_RING = 40 * 4096


@pytest.fixture(scope="module")
def bounded():
    assert response_ring_for(MAX_TEXTS, HIDDEN) > SMALL_RING  # the default would not bound a text
    srv = ServerProcess("--max-token-vectors", str(MAX_TOKEN_VECTORS), "--max-texts-per-request", str(MAX_TEXTS),
                        "--response-ring-bytes", str(SMALL_RING)).start()
    yield srv
    assert srv.terminate() == 0


def tokens_of(reply: pb.EmbedResponse) -> list[np.ndarray]:
    assert not reply.HasField("error"), reply.error.message
    rows = np.frombuffer(reply.token_embeddings, np.float32).reshape(-1, reply.dims)
    assert len(rows) == sum(reply.token_counts)
    return np.split(rows, np.cumsum(reply.token_counts)[:-1])


def test_token_vectors_equal_hf_last_hidden_state(stub, hf_hidden):
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS, outputs=[pb.OUTPUT_TOKENS]), timeout=30)
    assert reply.rows == 0 and reply.embeddings == b""  # dense not asked
    assert list(reply.token_counts) == [len(h) for h in hf_hidden]
    for ours, theirs in zip(tokens_of(reply), hf_hidden):
        assert cosine_rows(ours, theirs).min() >= 0.99999
        assert np.abs(ours - theirs).max() <= 1e-4  # raw: normalize false


def test_dense_and_tokens_in_one_request_match_the_plain_answer_and_the_reference(stub, reference, hf_hidden):
    both = stub.Embed(pb.EmbedRequest(texts=TEXTS, normalize=True, outputs=[pb.OUTPUT_DENSE, pb.OUTPUT_TOKENS]),
                      timeout=30)
    dense = vectors(both)
    plain = vectors(stub.Embed(pb.EmbedRequest(texts=TEXTS, normalize=True), timeout=30))
    assert dense.shape == (len(TEXTS), HIDDEN)
    assert cosine_rows(dense, plain).min() >= 0.99999
    assert cosine_rows(dense, reference(TEXTS)).min() >= 0.99999
    for ours, theirs in zip(tokens_of(both), hf_hidden):
        assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # normalize applies to tokens too
        assert cosine_rows(ours, theirs).min() >= 0.99999


def test_dimensions_cut_every_vector_before_it_is_normalized(stub, hf_hidden):
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS[:1], dimensions=128, normalize=True,
                                       outputs=[pb.OUTPUT_DENSE, pb.OUTPUT_TOKENS]), timeout=30)
    assert reply.dims == 128
    want = hf_hidden[0][:, :128]
    assert cosine_rows(tokens_of(reply)[0], want).min() >= 0.99999
    mean = hf_hidden[0].mean(axis=0)[:128]
    assert cosine_rows(vectors(reply), mean[None]).min() >= 0.99999


def test_python_client_and_openai_route(server, hf_hidden):
    with Client(server.listen) as client:
        got = client.embed_tokens(TEXTS, normalize=False)
    assert [len(g) for g in got] == [len(h) for h in hf_hidden]
    assert all(cosine_rows(g, h).min() >= 0.99999 for g, h in zip(got, hf_hidden))
    body = json.dumps({"input": TEXTS[:2], "outputs": ["dense", "tokens"], "normalize": False}).encode()
    reply = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/embeddings",
                                                          body), timeout=30)
    data = json.loads(reply.read())["data"]
    assert [d["index"] for d in data] == [0, 1]
    for item, theirs in zip(data, hf_hidden):
        assert cosine_rows(np.array(item["token_embeddings"]), theirs).min() >= 0.99999
        assert cosine_rows(np.array([item["embedding"]]), theirs.mean(axis=0)[None]).min() >= 0.99999
    only = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/embeddings",
        json.dumps({"input": "Hi", "outputs": ["tokens"]}).encode()), timeout=30).read())["data"][0]
    assert "embedding" not in only and len(only["token_embeddings"]) == len(hf_hidden[2])


@pytest.mark.parametrize("request_fields, words", [
    ({"outputs": [pb.OUTPUT_SPARSE]}, "needs a model with a sparse head"),
    ({"outputs": [99]}, "outputs holds 99"),
    ({"outputs": [pb.OUTPUT_TOKENS], "encoding": pb.ENCODING_INT8}, "ENCODING_FLOAT32"),
    ({"outputs": [pb.OUTPUT_TOKENS], "long_input": pb.LONG_INPUT_CHUNK_MEAN}, "not to chunks"),
], ids=["sparse", "unknown", "int8", "chunk-mean"])
def test_bad_outputs_are_refused_naming_the_field(stub, request_fields, words):
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(texts=["a text"], **request_fields), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outputs" in err.value.details() and words in err.value.details(), err.value.details()
    assert len(vectors(stub.Embed(pb.EmbedRequest(texts=["still answered"]), timeout=30))) == 1


def test_http_refusals_name_outputs(server):
    for body, words in (({"input": "a", "outputs": ["sparse"]}, "sparse head"),
                        ({"input": "a", "outputs": []}, "empty list"),
                        ({"input": "a", "outputs": ["colbert"]}, "dense, sparse, tokens")):
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/embeddings", json.dumps(body).encode())
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        assert err.value.code == 400
        error = json.loads(err.value.read())["error"]
        assert words in error["message"] and (error["param"] or "").startswith("outputs"), error


def test_token_vectors_past_the_bounds_are_refused(bounded):
    per_text = records.max_batch_rows(Ring.max_record_for(SMALL_RING), HIDDEN)
    assert MAX_TEXTS < per_text < 64
    with grpc.insecure_channel(bounded.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        ok = stub.Embed(pb.EmbedRequest(texts=TEXTS, outputs=[pb.OUTPUT_TOKENS]), timeout=30)
        assert sum(ok.token_counts) <= MAX_TOKEN_VECTORS
        long = " ".join(["word"] * 100)
        for texts, words in (([" ".join(["word"] * 40)] * 4, f"over the server's --max-token-vectors of "
                                                             f"{MAX_TOKEN_VECTORS}"),
                             ([long], f"over the {per_text} token vectors one answer carries")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Embed(pb.EmbedRequest(texts=texts, outputs=[pb.OUTPUT_TOKENS],
                                           truncate=pb.TRUNCATE_END), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in err.value.details(), err.value.details()
        # The long text as a dense vector is still served: the bound is the token vectors'.
        assert vectors(stub.Embed(pb.EmbedRequest(texts=[long], truncate=pb.TRUNCATE_END), timeout=30)).shape == (1, 384)


def test_tei_embed_all_is_the_raw_hidden_state(server, hf_hidden):
    body = json.dumps({"inputs": TEXTS[:2]}).encode()
    reply = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{server.http_port}/embed_all", body,
                                                          headers={"Content-Type": "application/json"}), timeout=30)
    answer = json.loads(reply.read())
    assert len(answer) == 2
    for ours, theirs in zip(answer, hf_hidden):
        assert np.abs(np.array(ours) - theirs).max() <= 1e-4  # TEI's are raw hidden states
