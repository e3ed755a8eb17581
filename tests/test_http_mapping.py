"""The HTTP body maps onto every EmbedRequest field (no server needed: this is the mapping alone)."""
from __future__ import annotations

import json

import msgspec
import pytest

from pollen.server.http_api.door import EmbeddingsBody, Rejected, to_embed_request
from pollen.server.http_api.http11 import Request
from pollen.v1 import embedder_pb2 as pb

# EmbedRequest fields whose HTTP name differs, or that HTTP has no use for.
_HTTP_NAME = {"texts": "input", "token_ids": "input"}
_NOT_ON_HTTP = {"id"}  # one request per HTTP call: nothing to match answers with


def http(body: dict) -> Request:
    return Request("POST", "/v1/embeddings", "", {"content-type": "application/json"}, json.dumps(body).encode())


def test_every_embed_request_field_has_an_http_name():
    body_fields = {f.name for f in msgspec.structs.fields(EmbeddingsBody)}
    for field in pb.EmbedRequest.DESCRIPTOR.fields:
        if field.name not in _NOT_ON_HTTP:
            assert _HTTP_NAME.get(field.name, field.name) in body_fields, field.name


def test_all_options_arrive_in_the_request():
    message, encoding_format = to_embed_request(http({
        "input": ["a", "b"], "model": "m", "dimensions": 64, "encoding_format": "base64", "user": "u",
        "encoding": "int8", "normalize": False, "truncate": "start", "max_tokens": 100, "prompt_name": "query",
        "prompt": "p: ", "long_input": "chunk_mean", "priority": "bulk", "timeout_ms": 250}))
    assert encoding_format == "base64"
    assert message == pb.EmbedRequest(
        texts=["a", "b"], dimensions=64, normalize=False, encoding=pb.ENCODING_INT8, truncate=pb.TRUNCATE_START,
        max_tokens=100, prompt_name="query", prompt="p: ", long_input=pb.LONG_INPUT_CHUNK_MEAN,
        priority=pb.PRIORITY_BULK, timeout_ms=250, model="m")


def test_defaults_and_input_shapes():
    message, encoding_format = to_embed_request(http({"input": "one"}))
    assert encoding_format == "float"
    assert message == pb.EmbedRequest(texts=["one"], normalize=True)  # OpenAI's vectors are unit length
    assert list(to_embed_request(http({"input": [1, 2, 3]}))[0].token_ids[0].ids) == [1, 2, 3]
    assert [list(t.ids) for t in to_embed_request(http({"input": [[1, 2], [3]]}))[0].token_ids] == [[1, 2], [3]]
    chunks = to_embed_request(http({"chunks": ["first part", "second part"]}))[0]
    assert list(chunks.chunks) == ["first part", "second part"] and not chunks.texts


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "chunks": ["y"]}, "chunks"),
    ({"chunks": []}, "chunks"),
    ({"input": [[1, 2 ** 31]]}, "input"),
    ({"input": "x", "max_tokens": -1}, "max_tokens"),
    ({"input": "x", "timeout_ms": 1.5}, "timeout_ms"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(Rejected) as caught:
        to_embed_request(http(body))
    assert caught.value.param == param


def test_http_listen_flag_and_variable():
    from pollen.server.config import ServeConfig

    assert ServeConfig.from_args([], environ={}).http_listen == "127.0.0.1:8080"
    assert ServeConfig.from_args(["--http-listen", ""], environ={}).http_listen == ""  # no HTTP door
    assert ServeConfig.from_args([], environ={"POLLEN_HTTP_LISTEN": "0.0.0.0:9000"}).http_listen == "0.0.0.0:9000"
    with pytest.raises(ValueError, match="--http-listen must be host:port"):
        ServeConfig.from_args(["--http-listen", "8080"], environ={})
