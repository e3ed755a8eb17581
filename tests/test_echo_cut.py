"""Client input quoted in an error message is cut, through both doors: the answer says what was
wrong without growing with the request."""
from __future__ import annotations

import json

import grpc
import pytest

from pollen.common.errors import ECHO_CHARS, cut, echo
from pollen.v1 import embedder_pb2 as pb
from tests.test_http_door import post, raw_exchange


def test_cut_and_echo_say_how_long_the_input_was():
    assert cut("x" * ECHO_CHARS) == "x" * ECHO_CHARS
    assert cut("x" * 1048576) == "x" * ECHO_CHARS + "... (cut: 1048576 characters)"
    assert echo("query") == "'query'"
    assert echo("q" * 20000) == repr("q" * ECHO_CHARS) + "... (cut: 20000 characters)"
    assert echo(b"\0" * 500).endswith("... (cut: 500 bytes)")


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "encoding": "e" * 1_000_000}, "encoding"),  # msgspec quotes the bad enum value
    ({"input": "x", "k" * 100_000: 1}, None),                    # and the unknown field's name
    ({"input": "x", "prompt_name": "p" * 100_000}, "prompt_name"),  # admission quotes the prompt name
])
def test_http_error_bodies_do_not_echo_long_input(server, body, param):
    data = json.dumps(body).encode()
    status, payload = post(server, data)
    assert status == 400
    message = payload["error"]["message"]
    assert "(cut: " in message and len(json.dumps(payload)) < 1000, message[:300]
    assert payload["error"]["param"] == param


def test_http_protocol_errors_do_not_echo_long_input(server):
    status, _, body = raw_exchange(server, b"GET /" + b"a" * 12000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 404 and len(body) < 1000 and b"(cut: 12001 characters)" in body
    status, _, body = raw_exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\n" + b"y" * 12000 + b"\r\n\r\n")
    # A malformed header line is never quoted, cut or whole (it may hold credentials).
    assert status == 400 and len(body) < 1000 and b"yyyy" not in body and b"not quoted" in body


def test_grpc_prompt_name_over_16_kib_is_invalid_argument_and_cut(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(texts=["x"], prompt_name="p" * 20000), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED (trailer too large)
    assert "(cut: 20000 characters)" in err.value.details() and len(err.value.details()) < 500


def test_grpc_stream_id_is_cut_in_its_error(stub):
    slow = pb.EmbedRequest(id="i" * 20000, texts=["word " * 400] * 64, truncate=pb.TRUNCATE_END)
    again = pb.EmbedRequest(id="i" * 20000, texts=["again"])
    answers = list(stub.EmbedStream(iter([slow, again]), timeout=120))
    (error,) = [a for a in answers if a.HasField("error")]
    assert "still in flight" in error.error.message and "(cut: 20000 characters)" in error.error.message
    assert len(error.error.message) < 500


