"""TEI's gRPC API (tei.v1) on pollen's gRPC port, driven by the real `tei-client` package (its
GrpcClient, and its generated stubs for the calls the client does not make), against two real
servers: an embedder with a tiny cross-encoder beside it, and a reranker first with a tiny
classifier. Every answer equals pollen's own pollen.v1 answer for the same texts; what pollen
cannot produce (sparse and per-token vectors) and tasks no model serves are refused
FAILED_PRECONDITION naming what is missing; the streams answer in order and end at the first
failure, as TEI's do."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pollen.common.model_spec import default_model_path
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.test_classify import make_classifier
from tests.test_rerank_api import DOCS, QUERY, make_cross_encoder

tei_client = pytest.importorskip("tei_client")
from tei_client.stubs import tei_pb2 as tei  # noqa: E402
from tei_client.stubs import tei_pb2_grpc as tei_grpc  # noqa: E402

TEXTS = ["a bee on a flower", "the stock market closed higher", "honey is made from nectar", "naïve café ☕ crème"]


@pytest.fixture(scope="module", autouse=True)
def event_loop_for_grpc_client():
    """tei-client's GrpcClient opens a grpc.aio channel as it is built, which takes the thread's
    event loop; an earlier test's asyncio.run leaves the main thread none."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    asyncio.set_event_loop(None)
    loop.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return (make_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder")),
            make_classifier(tmp_path_factory.mktemp("tiny-classifier")))


@pytest.fixture(scope="module")
def embedder(models):
    srv = ServerProcess("--model", default_model_path(), "--model", models[0],
                        "--served-model-name", "minilm", "--served-model-name", "ranker").start()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def reranker(models):
    srv = ServerProcess("--model", models[0], "--model", models[1],
                        "--served-model-name", "ranker", "--served-model-name", "tiny-classify").start()
    yield srv
    assert srv.terminate() == 0


def ours(server):
    return pb_grpc.EmbedderStub(grpc.insecure_channel(server.listen))


def test_the_descriptor_is_teis_own():
    """pollen's tei.proto compiles to the descriptor tei-client carries: every name and number is TEI's."""
    from pollen.tei.v1 import tei_pb2

    assert tei_pb2.DESCRIPTOR.name == "tei.proto"
    assert tei_pb2.DESCRIPTOR.serialized_pb == tei.DESCRIPTOR.serialized_pb


def test_info_and_health(embedder, reranker):
    client = tei_client.GrpcClient(embedder.listen)
    assert client.health()
    info = client.info()
    mine = ours(embedder).Info(pb.InfoRequest(), timeout=10)
    assert info.server_model_id == "minilm" == mine.model and info.server_model_dtype == "float32"
    assert info.server_model_type == tei_client.ModelType.Embedding
    assert info.max_input_length == mine.max_tokens
    assert info.max_client_batch_size == mine.max_texts_per_request
    assert info.version
    assert tei_client.GrpcClient(reranker.listen).info().server_model_type == tei_client.ModelType.Reranker
    with grpc.insecure_channel(embedder.listen) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = {name: health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                  for name in ("tei.v1.Info", "tei.v1.Embed", "tei.v1.Rerank", "tei.v1.Tokenize", "tei.v1.Predict")}
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert status == {"tei.v1.Info": serving, "tei.v1.Embed": serving, "tei.v1.Rerank": serving,
                          "tei.v1.Tokenize": serving, "tei.v1.Predict": not_serving}  # no classifier here
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        listed = {s.name for s in reply.list_services_response.service}
        assert {"pollen.v1.Embedder", "tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank",
                "tei.v1.Tokenize"} <= listed


def test_embed_equals_pollens_answer(embedder):
    got = np.array(tei_client.GrpcClient(embedder.listen).embed(TEXTS), np.float32)  # normalize=True: its default
    reply = ours(embedder).Embed(pb.EmbedRequest(texts=TEXTS, normalize=True), timeout=30)
    want = np.frombuffer(reply.embeddings, np.float32).reshape(reply.rows, reply.dims)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5
    raw = tei_grpc.EmbedStub(grpc.insecure_channel(embedder.listen)).Embed(tei.EmbedRequest(inputs=TEXTS[0]),
                                                                           timeout=30)
    assert abs(np.linalg.norm(raw.embeddings) - 1) > 1e-3  # normalize false: as it comes
    assert raw.metadata.compute_tokens > 0 and raw.metadata.compute_chars == len(TEXTS[0])
    meta = raw.metadata  # pollen's timing.tokenize_us, queue and inference as TEI names them, within the total
    assert 0 < meta.tokenization_time_ns and 0 < meta.inference_time_ns
    assert meta.tokenization_time_ns + meta.queue_time_ns <= meta.total_time_ns
    assert reply.timing.tokenize_us > 0


def test_embed_stream_answers_in_order_and_ends_at_the_first_failure(embedder):
    stub = tei_grpc.EmbedStub(grpc.insecure_channel(embedder.listen))
    texts = [f"text number {i} " * (1 + i % 7) for i in range(40)]
    got = [np.array(r.embeddings) for r in stub.EmbedStream(iter(tei.EmbedRequest(inputs=t, normalize=True)
                                                                  for t in texts), timeout=60)]
    reply = ours(embedder).Embed(pb.EmbedRequest(texts=texts, normalize=True), timeout=30)
    want = np.frombuffer(reply.embeddings, np.float32).reshape(reply.rows, reply.dims)
    assert np.abs(np.array(got) - want).max() <= 1e-5
    messages = [tei.EmbedRequest(inputs="fine"), tei.EmbedRequest(inputs=""), tei.EmbedRequest(inputs="never")]
    answers = []
    with pytest.raises(grpc.RpcError) as err:
        for answer in stub.EmbedStream(iter(messages), timeout=30):
            answers.append(answer)
    assert len(answers) == 1
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs is empty" in err.value.details()


def test_too_long_input_refused_unless_truncated(embedder):
    stub = tei_grpc.EmbedStub(grpc.insecure_channel(embedder.listen))
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(tei.EmbedRequest(inputs="bee " * 600), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    right = stub.Embed(tei.EmbedRequest(inputs="bee " * 600 + "end", truncate=True), timeout=30)
    left = stub.Embed(tei.EmbedRequest(inputs="start " + "bee " * 600, truncate=True,
                                       truncation_direction=tei.TRUNCATION_DIRECTION_LEFT), timeout=30)
    for reply, truncate in ((right, pb.TRUNCATE_END), (left, pb.TRUNCATE_START)):
        text = "bee " * 600 + "end" if truncate == pb.TRUNCATE_END else "start " + "bee " * 600
        mine = ours(embedder).Embed(pb.EmbedRequest(texts=[text], truncate=truncate), timeout=30)
        assert np.abs(np.array(reply.embeddings) - np.frombuffer(mine.embeddings, np.float32)).max() <= 1e-5


def test_embed_all_is_pollens_token_vectors_and_sparse_is_refused(embedder):
    """EmbedAll (tei-client's embed_all, over EmbedAllStream) and /embed_all (its HttpClient) answer
    pollen.v1's token vectors, not normalized; EmbedSparse needs a sparse model."""
    mine = ours(embedder).Embed(pb.EmbedRequest(texts=TEXTS[:2], outputs=[pb.OUTPUT_TOKENS]), timeout=30)
    want = np.split(np.frombuffer(mine.token_embeddings, np.float32).reshape(-1, mine.dims),
                    np.cumsum(mine.token_counts)[:-1])
    for client in (tei_client.GrpcClient(embedder.listen), tei_client.HttpClient(f"http://{embedder.http_listen}")):
        got = client.embed_all(TEXTS[:2])
        assert [np.array(g, np.float32).shape for g in got] == [w.shape for w in want]
        assert max(np.abs(np.array(g, np.float32) - w).max() for g, w in zip(got, want)) <= 1e-5
    stub = tei_grpc.EmbedStub(grpc.insecure_channel(embedder.listen))
    for call in (lambda: stub.EmbedSparse(tei.EmbedSparseRequest(inputs="bee"), timeout=10),
                 lambda: list(stub.EmbedSparseStream(iter([tei.EmbedSparseRequest(inputs="bee")]), timeout=10))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "sparse (SPLADE)" in err.value.details()
    assert len(tei_client.GrpcClient(embedder.listen).embed(["still answered"])[0]) == 384


def test_tokenize_and_decode_equal_pollens_ids(embedder):
    client = tei_client.GrpcClient(embedder.listen)
    results = client.tokenize(TEXTS)
    mine = ours(embedder).Tokenize(pb.TokenizeRequest(texts=TEXTS), timeout=10)
    for text, result, ids in zip(TEXTS, results, mine.tokens):
        assert [t.id for t in result.tokens] == list(ids.ids)
        assert result.tokens[0].special and result.tokens[0].text == "[CLS]"
        data = text.encode()
        for token in result.tokens[1:-1]:  # offsets in UTF-8 bytes of the text
            assert not token.special and data[token.start:token.stop].decode() == token.text
    raw = tei_grpc.TokenizeStub(grpc.insecure_channel(embedder.listen)).Tokenize(
        tei.EncodeRequest(inputs=TEXTS[0], add_special_tokens=True), timeout=10)
    assert not raw.tokens[0].HasField("start") and raw.tokens[1].HasField("start")  # special tokens have no offsets
    bare = client.tokenize("café", add_special_tokens=False)[0].tokens
    assert not any(t.special for t in bare) and bare[-1].stop == len("café".encode())
    assert client.decode(list(mine.tokens[0].ids)) == TEXTS[0]
    assert client.decode([list(t.ids) for t in mine.tokens[:2]]) == TEXTS[:2]
    with pytest.raises(grpc.RpcError) as err:
        client.decode([10 ** 6])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in err.value.details()


def test_rerank_equals_pollens_answer(reranker):
    result = tei_client.GrpcClient(reranker.listen).rerank(QUERY, DOCS, return_text=True)
    mine = ours(reranker).Rerank(pb.RerankRequest(query=QUERY, documents=DOCS), timeout=30)
    assert [r.index for r in result.ranks] == [r.index for r in mine.results]
    assert np.allclose([r.score for r in result.ranks], [r.score for r in mine.results], atol=1e-6)
    assert [r.text for r in result.ranks] == [DOCS[r.index] for r in mine.results]
    stub = tei_grpc.RerankStub(grpc.insecure_channel(reranker.listen))
    streamed = stub.RerankStream(iter(tei.RerankStreamRequest(query=QUERY, text=d, raw_scores=True) for d in DOCS),
                                 timeout=30)
    raw = ours(reranker).Rerank(pb.RerankRequest(query=QUERY, documents=DOCS, raw_scores=True), timeout=30)
    assert [r.index for r in streamed.ranks] == [r.index for r in raw.results]
    assert np.allclose([r.score for r in streamed.ranks], [r.score for r in raw.results], atol=1e-5)
    assert not any(r.HasField("text") for r in streamed.ranks)
    with pytest.raises(grpc.RpcError) as err:
        stub.Rerank(tei.RerankRequest(query=QUERY), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts cannot be empty" in err.value.details()


def test_predict_equals_pollens_classify(reranker):
    stub = tei_grpc.PredictStub(grpc.insecure_channel(reranker.listen))
    mine = ours(reranker).Classify(pb.ClassifyRequest(texts=TEXTS), timeout=30)
    got = list(stub.PredictStream(iter(tei.PredictRequest(inputs=t) for t in TEXTS), timeout=30))
    for answer, result in zip(got, mine.results, strict=True):
        assert [p.label for p in answer.predictions] == [s.label for s in result.labels]
        assert np.allclose([p.score for p in answer.predictions], [s.score for s in result.labels], atol=1e-6)
    pair = stub.PredictPair(tei.PredictPairRequest(inputs=TEXTS[:2]), timeout=30)
    mine = ours(reranker).Classify(pb.ClassifyRequest(texts=TEXTS[:1], text_pairs=TEXTS[1:2]), timeout=30)
    assert [p.label for p in pair.predictions] == [s.label for s in mine.results[0].labels]
    with pytest.raises(grpc.RpcError) as err:
        stub.PredictPair(tei.PredictPairRequest(inputs=TEXTS[:3]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Given: 3" in err.value.details()


def test_a_task_no_model_serves_is_a_failed_precondition(embedder, reranker):
    with pytest.raises(grpc.RpcError) as err:
        tei_grpc.PredictStub(grpc.insecure_channel(embedder.listen)).Predict(tei.PredictRequest(inputs="bee"),
                                                                             timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Predict needs a classifier model, and none is served here" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        tei_grpc.EmbedStub(grpc.insecure_channel(reranker.listen)).Embed(tei.EmbedRequest(inputs="bee"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Embed needs an embedding model" in err.value.details()


def test_tei_client_over_http_gets_pollens_answers(embedder, reranker):
    """tei-client's HttpClient, unchanged, against TEI's HTTP routes (server/http_api/tei.py): health,
    info, embed, tokenize and rerank give what pollen.v1 gives for the same texts."""
    client = tei_client.HttpClient(f"http://{embedder.http_listen}")
    assert client.health()
    assert client.info().server_model_id == "minilm"
    got = np.array(client.embed(TEXTS), np.float32)
    reply = ours(embedder).Embed(pb.EmbedRequest(texts=TEXTS, normalize=True), timeout=30)
    assert np.abs(got - np.frombuffer(reply.embeddings, np.float32).reshape(reply.rows, reply.dims)).max() <= 1e-5
    (tokens,) = client.tokenize(TEXTS[:1])
    ids = ours(embedder).Tokenize(pb.TokenizeRequest(texts=TEXTS[:1]), timeout=30).tokens[0].ids
    assert [t.id for t in tokens.tokens] == list(ids)
    ranker = tei_client.HttpClient(f"http://{reranker.http_listen}")
    ranked = ranker.rerank(QUERY, DOCS)
    mine = ours(reranker).Rerank(pb.RerankRequest(query=QUERY, documents=DOCS), timeout=30)
    assert [r.index for r in ranked.ranks] == [r.index for r in mine.results]
    assert np.allclose([r.score for r in ranked.ranks], [r.score for r in mine.results], atol=1e-6)
