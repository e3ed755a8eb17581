"""RerankStream through a real `pollen serve` of a tiny random BERT cross-encoder (the
checkpoint of tests/test_rerank_api.py): many messages in flight answered by id with unary
Rerank's scores, and bad messages answered with an error while their neighbours are answered."""
from __future__ import annotations

import random

import grpc
import numpy as np
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.test_rerank_api import DOCS, QUERY, make_cross_encoder

QUERIES = [QUERY, "where do bees live", "banana bread", "stock prices", "wax"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder"))
    # A window below the messages sent, so that the stream's bound is crossed as well.
    srv = ServerProcess("--model", path, "--served-model-name", "tiny-rerank", "--max-stream-in-flight", "16").start()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.listen) as channel:
        yield pb_grpc.EmbedderStub(channel)


def by_index(reply: pb.RerankResponse) -> dict[int, float]:
    return {r.index: r.score for r in reply.results}


def test_many_messages_in_flight_answered_by_id_as_unary_rerank(stub):
    rng = random.Random(11)
    print("seed 11")
    requests = []
    for i in range(60):
        docs = rng.sample(DOCS, rng.randint(1, len(DOCS)))
        top_n = {"top_n": rng.randint(1, len(docs))} if i % 3 == 0 else {}
        requests.append(pb.RerankRequest(id=f"m{i}", query=rng.choice(QUERIES), documents=docs,
                                         raw_scores=i % 2 == 0, **top_n))
    answers = list(stub.RerankStream(iter(requests), timeout=120))
    assert sorted(a.id for a in answers) == sorted(r.id for r in requests)
    got = {a.id: a for a in answers}
    for request in requests:
        answer = got[request.id]
        assert not answer.HasField("error"), answer.error
        expected = stub.Rerank(request, timeout=30)
        assert [r.index for r in answer.results] == [r.index for r in expected.results]
        np.testing.assert_allclose(list(by_index(answer).values()), list(by_index(expected).values()), atol=1e-6)
        assert answer.model == "tiny-rerank" and answer.usage.prompt_tokens == expected.usage.prompt_tokens


def test_bad_messages_get_errors_and_their_neighbours_answers(stub, server):
    heavy = pb.RerankRequest(id="dup", query=QUERY, documents=[d * 4 for d in DOCS] * 80)  # long in flight
    messages = [
        heavy,
        pb.RerankRequest(id="dup", query=QUERY, documents=DOCS),
        pb.RerankRequest(id="a", query=QUERY, documents=DOCS),
        pb.RerankRequest(id="empty", query=QUERY, documents=[]),
        pb.RerankRequest(query=QUERY, documents=DOCS),
        pb.RerankRequest(id="b", query=QUERY, documents=DOCS[:2], top_n=0),
        pb.RerankRequest(id="c", query=QUERY, documents=DOCS[:2], model="nope"),
        pb.RerankRequest(id="d", query=QUERY, documents=DOCS[:2]),
    ]
    answers: dict[str, list[pb.RerankResponse]] = {}
    for answer in stub.RerankStream(iter(messages), timeout=120):
        answers.setdefault(answer.id, []).append(answer)
    errors = {key: [a.error for a in group if a.HasField("error")] for key, group in answers.items()}
    (dup_error,) = errors["dup"]
    assert "still in flight" in dup_error.message and dup_error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert len(next(a for a in answers["dup"] if not a.HasField("error")).results) == len(heavy.documents)
    assert "documents is empty" in errors["empty"][0].message
    assert "id is required on RerankStream messages" in errors[""][0].message
    assert "top_n" in errors["b"][0].message
    assert "model" in errors["c"][0].message and "tiny-rerank (rerank)" in errors["c"][0].message
    for key, count in (("a", len(DOCS)), ("d", 2)):
        (answer,) = answers[key]
        assert not answer.HasField("error") and len(answer.results) == count
    assert server.healthy()


def test_undecodable_message_ends_the_stream_after_the_others(server):
    with grpc.insecure_channel(server.listen) as channel:
        call = channel.stream_stream("/pollen.v1.Embedder/RerankStream", request_serializer=lambda b: b,
                                     response_deserializer=pb.RerankResponse.FromString)
        good = pb.RerankRequest(id="ok", query=QUERY, documents=DOCS[:1]).SerializeToString()
        ids = []
        with pytest.raises(grpc.RpcError) as err:
            for answer in call(iter([good, b"\xff\xff\xff"]), timeout=60):
                ids.append(answer.id)
    assert ids == ["ok"] and err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "message 2 of this stream is not a valid pollen.v1.RerankRequest" in err.value.details()
