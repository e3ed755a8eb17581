"""A rerank call of many documents, pipelined (server/rerank.py): its documents tokenized in
chunks, each chunk sent to the worker as a request of its own once its pairs are made, the answers
joined. Through a real `pollen serve` of a tiny random BERT cross-encoder (the real MiniLM
tokenizer): the scores and order equal sentence-transformers' CrossEncoder (fp32) over every
chunk, the chunks reach the worker as separate requests, and a refusal found in a later chunk
names its document and loses nothing else."""
from __future__ import annotations

import http.client

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from load import corpus
from pollen.server.rerank import FIRST_CHUNK_CHARS, chunk_bounds
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.test_rerank_api import QUERY, make_cross_encoder

# 60 documents of 300 words (about 2,200 characters, 132,000 in all): chunks of 16K, 32K, 64K and
# the rest. The tiny model's limit (128 tokens a pair) cuts each one; every seventh holds DEL, which
# tokie leaves to the tokenizers library (server/tokie_ids.py), so a chunk has both groups.
DOCUMENTS = 60


def documents(count: int = DOCUMENTS, words: int = 300) -> list[str]:
    pool = " ".join(corpus.documents(400)).split()
    rng = np.random.default_rng(11)
    docs = [" ".join(pool[i:i + words]) for i in rng.integers(0, len(pool) - words, count)]
    return [d + " \x7f" if i % 7 == 3 else d for i, d in enumerate(docs)]


def scrape(server: ServerProcess) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.labels}


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = make_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder"))
    srv = ServerProcess("--model", path).start()
    srv.path = path
    yield srv
    assert srv.terminate() == 0


def test_chunks_start_at_the_first_size_and_double():
    docs = ["x" * 1000] * 100
    bounds = chunk_bounds(docs)
    assert bounds[0] == (0, FIRST_CHUNK_CHARS // 1000 + 1)  # the document that reaches 16K chars ends it
    assert [b - a for a, b in bounds] == [17, 33, 50]  # 17K, then 33K (>= 32K), then what is left
    assert [a for a, _ in bounds[1:]] == [b for _, b in bounds[:-1]] and bounds[-1][1] == 100
    assert chunk_bounds(["x" * 10] * 5) == [(0, 5)]  # under the first size: one chunk
    assert chunk_bounds(["x" * 40_000, "y"]) == [(0, 1), (1, 2)]  # a document longer than a chunk ends it
    assert chunk_bounds([]) == []


def test_a_pipelined_call_scores_as_cross_encoder(reranker):
    from sentence_transformers import CrossEncoder

    docs = documents()
    chunks = len(chunk_bounds(docs))
    assert chunks == 4
    scored = CrossEncoder(reranker.path, device="cpu", max_length=128).predict([(QUERY, d) for d in docs])
    requests_before = scrape(reranker)["pollen_queue_seconds_count"]
    with grpc.insecure_channel(reranker.listen) as channel:
        reply = pb_grpc.EmbedderStub(channel).Rerank(pb.RerankRequest(query=QUERY, documents=docs), timeout=60)
    ours = np.zeros(len(docs))
    for r in reply.results:
        ours[r.index] = r.score
    np.testing.assert_allclose(ours, scored, atol=1e-4)
    order = [r.index for r in reply.results]  # best first by the reference, but for near ties
    assert sorted(order) == list(range(len(docs))) and np.all(np.diff(scored[order]) <= 2e-4)
    assert reply.usage.prompt_tokens == 128 * len(docs)  # every pair cut to the limit
    # The worker answered a request a chunk (each answer is timed once in the histogram).
    assert scrape(reranker)["pollen_queue_seconds_count"] - requests_before == chunks


@pytest.mark.parametrize("bad", [100, 150])
def test_a_refusal_in_a_later_chunk_names_its_document(reranker, bad):
    """TRUNCATE_NONE, every document within its room but one, in the second or third chunk: the
    call is refused naming it by its request index after the chunks before it were sent; the
    server holds none of the call's tokens afterwards and answers the next call."""
    docs = documents(160, words=50)  # about 370 characters each: chunks of 0-45, 45-135, 135-160
    assert chunk_bounds(docs) == [(0, 45), (45, 135), (135, 160)]
    docs[bad] = "honey " * 500
    with grpc.insecure_channel(reranker.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Rerank(pb.RerankRequest(query=QUERY, documents=docs, truncate=pb.TRUNCATE_NONE), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"documents[{bad}] has more than" in err.value.details()
        docs[bad] = "honey"
        reply = stub.Rerank(pb.RerankRequest(query=QUERY, documents=docs, truncate=pb.TRUNCATE_NONE), timeout=60)
    assert len(reply.results) == len(docs)
    assert scrape(reranker)["pollen_queued_tokens"] == 0


def test_an_empty_document_in_a_later_chunk_is_refused_before_any_is_sent(reranker):
    docs = documents()
    docs[50] = ""
    before = scrape(reranker)["pollen_queue_seconds_count"]
    with grpc.insecure_channel(reranker.listen) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.EmbedderStub(channel).Rerank(pb.RerankRequest(query=QUERY, documents=docs), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "documents[50] is empty" in err.value.details()
    assert scrape(reranker)["pollen_queue_seconds_count"] == before
