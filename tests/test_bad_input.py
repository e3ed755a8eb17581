"""Bad input: a clear error that names the problem, and nothing else is lost."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from pollen.v1 import embedder_pb2 as pb
from tests.conftest import vectors

LONG = "word " * 400  # ~400 tokens, over all-MiniLM-L6-v2's 256

BAD = {
    "neither texts nor token_ids": (pb.EmbedRequest(id="b1"), "neither texts nor token_ids nor chunks"),
    "both texts and token_ids": (
        pb.EmbedRequest(id="b2", texts=["x"], token_ids=[pb.TokenIds(ids=[101, 102])]), "not both texts and token_ids"),
    "texts and chunks": (pb.EmbedRequest(id="b12", texts=["x"], chunks=["y"]), "not both texts and chunks"),
    "dimensions below 32": (pb.EmbedRequest(id="b13", texts=["x"], dimensions=16), "from 32 to 384"),
    "unknown prompt_name": (pb.EmbedRequest(id="b14", texts=["x"], prompt_name="query"), "defines no prompts"),
    "max_tokens over the model's": (pb.EmbedRequest(id="b15", texts=["x"], max_tokens=257), "max_tokens 257"),
    "unknown priority": (pb.EmbedRequest(id="b16", texts=["x"], priority=5), "priority 5 is not a known"),
    "unknown long_input": (pb.EmbedRequest(id="b17", texts=["x"], long_input=3), "long_input 3 is not a known"),
    "CHUNK_MEAN with token_ids": (pb.EmbedRequest(id="b18", token_ids=[pb.TokenIds(ids=[101, 102])],
                                                  long_input=pb.LONG_INPUT_CHUNK_MEAN), "not to token_ids"),
    "empty chunk": (pb.EmbedRequest(id="b19", chunks=["fine", ""]), "chunks[1] is empty"),
    "document over the limit": (pb.EmbedRequest(id="b20", chunks=[LONG]), "the document has"),
    "empty string": (pb.EmbedRequest(id="b3", texts=["fine", ""]), "texts[1] is empty"),
    "too long with truncate NONE": (pb.EmbedRequest(id="b4", texts=[LONG]), "over the model's limit of 256"),
    "token id over the vocabulary": (
        pb.EmbedRequest(id="b5", token_ids=[pb.TokenIds(ids=[101, 30522, 102])]), "id 30522, outside the vocabulary"),
    "negative token id": (pb.EmbedRequest(id="b6", token_ids=[pb.TokenIds(ids=[101, -5, 102])]), "id -5"),
    "dimensions above the model's": (pb.EmbedRequest(id="b7", texts=["x"], dimensions=385), "dimensions 385"),
    "unknown encoding": (pb.EmbedRequest(id="b8", texts=["x"], encoding=99), "encoding 99 is not a known"),
    "unknown truncate": (pb.EmbedRequest(id="b9", texts=["x"], truncate=7), "truncate 7 is not a known"),
    "more texts than the limit": (pb.EmbedRequest(id="b10", texts=["x"] * 65), "65 inputs in one request, over the limit of 64"),
    "prompt over 4096 characters": (pb.EmbedRequest(id="b21", texts=["x"], prompt="p" * 4097),
                                    "prompt has 4097 characters, over the limit of 4096"),
    "prompt leaving no room for text": (
        pb.EmbedRequest(id="b22", texts=["x"], prompt="a b c d e f", max_tokens=8, truncate=pb.TRUNCATE_END),
        "prompt has 6 tokens, which leave no room for text under the request's max_tokens 8"),
    "token ids too long with truncate NONE": (
        pb.EmbedRequest(id="b11", token_ids=[pb.TokenIds(ids=[1000] * 300)]), "token_ids[0] has 300 tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unary_bad_input_is_invalid_argument(stub, server, case):
    request, fragment = BAD[case]
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()
    assert server.healthy()


def test_int8_is_offered_with_one_scale_per_row(stub):
    reply = stub.Embed(pb.EmbedRequest(texts=["x", "y"], encoding=pb.ENCODING_INT8), timeout=30)
    assert (reply.rows, reply.dims, len(reply.embeddings), len(reply.scales)) == (2, 384, 768, 2)


def test_message_over_the_size_limit_is_refused(stub, server):
    # The session server runs with --max-request-bytes 1 MiB: refused by the server, saying so,
    # up to twice that; past it by gRPC itself.
    for size, says in ((1 << 20, "over the server's --max-request-bytes of 1048576"),
                       (3 << 20, "Received message larger than max")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(pb.EmbedRequest(texts=["x" * size]), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and says in err.value.details()
    assert server.healthy()
    assert vectors(stub.Embed(pb.EmbedRequest(texts=["still fine"]), timeout=30)).shape == (1, 384)


def test_stream_message_over_the_size_limit_fails_alone(stub, server):
    # One message a little over --max-request-bytes (1 MiB) among good ones on a stream: it gets
    # an error answer by its id, every other message its vectors, and the stream ends OK.
    good = [pb.EmbedRequest(id=f"good-{i}", texts=[f"sentence {i}"] * 4, truncate=pb.TRUNCATE_END) for i in range(8)]
    big = pb.EmbedRequest(id="big", texts=["y" * (1 << 20)])
    answers = {r.id: r for r in stub.EmbedStream(iter(good[:4] + [big] + good[4:]), timeout=120)}
    assert sorted(answers) == sorted([g.id for g in good] + ["big"])
    assert answers["big"].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert f"message 5 of this stream has {big.ByteSize()} bytes" in answers["big"].error.message
    for g in good:
        assert not answers[g.id].error.message and vectors(answers[g.id]).shape == (4, 384)


def test_stream_bad_messages_fail_alone(stub, server):
    good = [pb.EmbedRequest(id=f"good-{i}", texts=[f"sentence number {i}", "another"]) for i in range(6)]
    bad = [BAD[case][0] for case in BAD]
    # The slow message holds id "dup" in flight while a second "dup" arrives.
    slow = pb.EmbedRequest(id="dup", texts=[LONG] * 64, truncate=pb.TRUNCATE_END)
    mixed = [slow, pb.EmbedRequest(id="dup", texts=["again"])]
    for g, b in zip(good, bad):
        mixed += [g, b]
    mixed += good[len(bad):] + bad[len(good):] + [pb.EmbedRequest(texts=["no id"])]
    answers: dict[str, list] = {}
    for response in stub.EmbedStream(iter(mixed), timeout=120):
        answers.setdefault(response.id, []).append(response)

    for g in good:
        (reply,) = answers[g.id]
        assert vectors(reply).shape == (2, 384)
    for case, (request, fragment) in BAD.items():
        (reply,) = answers[request.id]
        assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], case
        assert fragment in reply.error.message, case
        assert reply.rows == 0 and not reply.embeddings
    dup = answers["dup"]
    assert len(dup) == 2
    errors = [r for r in dup if r.HasField("error")]
    assert len(errors) == 1 and "still in flight" in errors[0].error.message
    assert vectors(next(r for r in dup if not r.HasField("error"))).shape == (64, 384)
    (no_id,) = answers[""]
    assert "id is required" in no_id.error.message
    assert server.healthy()


def test_pre_tokenized_input_equals_texts(stub):
    texts = ["pre-tokenized input", "東京 🙂"]
    tokens = stub.Tokenize(pb.TokenizeRequest(texts=texts)).tokens
    a = vectors(stub.Embed(pb.EmbedRequest(texts=texts, normalize=True)))
    b = vectors(stub.Embed(pb.EmbedRequest(token_ids=tokens, normalize=True)))
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_tokenize_suggests_only_its_own_options(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(texts=[LONG], truncate=pb.TRUNCATE_NONE), timeout=30)
    assert "set truncate to TRUNCATE_END or TRUNCATE_START" in err.value.details()
    assert "long_input" not in err.value.details()  # TokenizeRequest has no long_input


def test_tokenize_checks_its_input_too(stub):
    for request, fragment in ((pb.TokenizeRequest(texts=["x"] * 65), "65 inputs in one request"),
                              (pb.TokenizeRequest(texts=["x"], truncate=9), "truncate 9 is not a known"),
                              (pb.TokenizeRequest(texts=["fine", ""]), "texts[1] is empty")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in err.value.details()
