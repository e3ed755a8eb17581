"""The HTTP door of the real `pollen serve`: the official openai client, then raw HTTP for the bad cases."""
from __future__ import annotations

import base64
import http.client
import json
import socket

import numpy as np
import pytest
from openai import BadRequestError, OpenAI

from pollen.v1 import embedder_pb2 as pb
from tests.conftest import vectors

TEXTS = ["hello", "東京は日本の首都です。", "a longer sentence about the weather and embeddings 🙂"]


@pytest.fixture(scope="module")
def openai_client(server):
    return OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0)


def grpc_vectors(stub, texts, **options) -> np.ndarray:
    return vectors(stub.Embed(pb.EmbedRequest(texts=texts, normalize=True, **options), timeout=60))


def post(server, body, path="/v1/embeddings", headers=None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    reply = conn.getresponse()
    status, payload = reply.status, json.loads(reply.read())
    conn.close()
    return status, payload


def assert_openai_error(payload: dict, *words: str) -> None:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]


@pytest.mark.parametrize("dimensions", [None, 32])
def test_openai_client_float_equals_grpc(openai_client, stub, dimensions):
    extra = {"dimensions": dimensions} if dimensions else {}
    reply = openai_client.embeddings.create(model="any", input=TEXTS, encoding_format="float", **extra)
    got = np.array([d.embedding for d in reply.data], dtype=np.float32)
    want = grpc_vectors(stub, TEXTS, dimensions=dimensions or 0)
    assert got.shape == want.shape == (3, dimensions or 384)
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert reply.object == "list" and reply.model
    tokens = stub.Tokenize(pb.TokenizeRequest(texts=TEXTS)).usage.prompt_tokens
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens


def test_openai_client_base64_equals_grpc(openai_client, stub):
    want = grpc_vectors(stub, TEXTS, dimensions=64)
    # Asked for base64 explicitly, the client hands the strings through untouched.
    raw = openai_client.embeddings.create(model="any", input=TEXTS, encoding_format="base64", dimensions=64)
    got = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in raw.data])
    np.testing.assert_allclose(got, want, atol=2e-6)
    # Left to itself, the client asks for base64 and decodes it into floats.
    default = openai_client.embeddings.create(model="any", input="hello", dimensions=64)
    np.testing.assert_allclose(np.array(default.data[0].embedding, np.float32), want[0], atol=2e-6)


def test_token_id_input_equals_text_input(server, stub):
    ids = [list(t.ids) for t in stub.Tokenize(pb.TokenizeRequest(texts=TEXTS[:2])).tokens]
    want = grpc_vectors(stub, TEXTS[:2])
    status, many = post(server, {"input": ids})
    assert status == 200
    np.testing.assert_allclose(np.array([d["embedding"] for d in many["data"]]), want, atol=2e-6)
    status, one = post(server, {"input": ids[0]})
    assert status == 200 and len(one["data"]) == 1
    np.testing.assert_allclose(np.array(one["data"][0]["embedding"]), want[0], atol=2e-6)


@pytest.mark.parametrize("encoding", ["float16", "bfloat16", "ubinary", "int8"])
def test_pollen_encodings_match_grpc_bytes(server, stub, encoding):
    enum = getattr(pb, f"ENCODING_{encoding.upper()}")
    want = stub.Embed(pb.EmbedRequest(texts=TEXTS, normalize=True, encoding=enum), timeout=60)
    rows = np.frombuffer(want.embeddings, np.uint8).reshape(want.rows, -1)
    status, b64 = post(server, {"input": TEXTS, "encoding": encoding, "encoding_format": "base64"})
    assert status == 200
    for i, item in enumerate(b64["data"]):
        assert base64.b64decode(item["embedding"]) == rows[i].tobytes()
    status, floats = post(server, {"input": TEXTS, "encoding": encoding})
    assert status == 200
    numbers = np.array([d["embedding"] for d in floats["data"]])
    if encoding == "float16":
        np.testing.assert_array_equal(numbers.astype(np.float16).view("<u2"), rows.view("<u2"))
    elif encoding == "bfloat16":
        bits = (numbers.astype(np.float32).view(np.uint32) >> 16).astype("<u2")
        np.testing.assert_array_equal(bits, rows.view("<u2"))
    else:  # int8 and ubinary: the integers themselves
        np.testing.assert_array_equal(numbers, rows.view("i1" if encoding == "int8" else "u1"))
    if encoding == "int8":
        np.testing.assert_allclose([d["scale"] for d in floats["data"]], list(want.scales))


def test_models_and_health(server, stub):
    info = stub.Info(pb.InfoRequest())
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    assert [m["id"] for m in models["data"]] == [info.model]
    assert models["data"][0]["quantization"] == info.models[0].quantization == "none"
    conn.request("GET", "/health")  # the same connection: keep-alive
    reply = conn.getresponse()
    assert (reply.status, json.loads(reply.read())) == (200, {"status": "SERVING"})
    conn.close()


@pytest.mark.parametrize("body, words, param", [
    (b'{"input": ["unterminated', ("not valid JSON",), None),
    (b"", ("not valid JSON",), None),
    ({"input": 5}, ("Expected", "$.input"), "input"),
    ({"input": ["ok", 7.5]}, ("$.input[1]",), "input[1]"),
    ({"input": "x", "dimensions": "32"}, ("Expected `int", "$.dimensions"), "dimensions"),
    ({"input": "x", "dimensions": -1}, (">= 0", "$.dimensions"), "dimensions"),
    ({"input": "x", "encoding_format": "hex"}, ("float", "base64"), "encoding_format"),
    ({"input": "x", "encoding": "int4"}, ("ubinary",), "encoding"),
    ({"input": "x", "normalise": True}, ("unknown field", "normalise"), None),
    ({"input": ""}, ("input[0] is an empty string",), "input"),
    ({"input": []}, ("empty list",), "input"),
    ({"input": [[]]}, ("input[0] is an empty list",), "input"),
    ({"input": ["a", 1]}, ("mixes",), "input"),
    ({"model": "x"}, ("input is required",), "input"),
    # Refused by the service: worded with this door's names, the field named in `param`.
    ({"input": "x", "dimensions": 100000}, ("dimensions 100000",), "dimensions"),
    ({"input": [[1, 2, 10 ** 9]]}, ("input[0] holds id 1000000000, outside the vocabulary",), "input"),
    ({"input": ["ok", "w " * 400], "truncate": "none"},
     ("input[1] has", 'set truncate to "end" or "start", or set long_input to "chunk_mean"'), "input"),
    ({"input": [[1, 2]], "long_input": "chunk_mean"}, ('long_input "chunk_mean" applies to texts',), "long_input"),
])
def test_bad_bodies_get_openai_style_400(server, body, words, param):
    status, payload = post(server, body)
    assert status == 400, payload
    assert_openai_error(payload, *words)
    assert "TRUNCATE_" not in payload["error"]["message"] and "LONG_INPUT_" not in payload["error"]["message"]
    assert payload["error"]["param"] == param


def test_openai_route_takes_2048_inputs_in_records_of_max_texts(server, stub):
    texts = [f"text {i} of bees" for i in range(130)]  # over the fixture's --max-texts-per-request of 64
    status, payload = post(server, {"input": texts})
    assert status == 200 and [d["index"] for d in payload["data"]] == list(range(130))
    got = np.array([d["embedding"] for d in payload["data"]])
    want = np.concatenate([grpc_vectors(stub, texts[i:i + 64]) for i in range(0, 130, 64)])
    assert np.abs(got - want).max() <= 1e-6
    status, payload = post(server, {"input": ["x"] * 2049})  # --max-openai-inputs: 2048
    assert status == 400
    assert_openai_error(payload, "over the limit of 2048")


def raw_exchange(server, data: bytes) -> tuple[int, dict, bytes]:
    """Send bytes as they are; read one response (status, headers, body) and what follows."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, rest


def test_oversized_body_is_413_and_read_by_the_client(server):
    body = json.dumps({"input": ["x" * 1000] * 1100}).encode()  # over the fixture's 1 MiB
    assert len(body) > 1 << 20
    status, payload = post(server, body)
    assert status == 413
    assert payload["error"]["code"] == "request_too_large" and "over the limit" in payload["error"]["message"]


@pytest.mark.parametrize("request_bytes, status", [
    (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404),
    (b"GET /v1/embeddings HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
    (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 12x\r\n\r\n", 400),
    (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 20000 + b"\r\n\r\n", 431),
    (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    (b"garbage\r\n\r\n", 400),
])
def test_protocol_errors_answer_and_close(server, request_bytes, status):
    got, headers, body = raw_exchange(server, request_bytes)
    assert got == status
    assert headers["Connection"] == "close"
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_keep_alive_pipelined_and_http10(server, stub):
    one = json.dumps({"input": "hello"}).encode()
    request = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(one), one)
    close = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    status, headers, rest = raw_exchange(server, request + request + close)  # three pipelined requests
    assert status == 200 and headers["Connection"] == "keep-alive"
    assert rest.count(b"HTTP/1.1 200 OK") == 2 and rest.endswith(b'{"status":"SERVING"}')
    first = json.loads(rest.split(b"HTTP/1.1")[0][:int(headers["Content-Length"])])
    np.testing.assert_allclose(first["data"][0]["embedding"], grpc_vectors(stub, ["hello"])[0], atol=2e-6)
    status, headers, body = raw_exchange(server, b"GET /health HTTP/1.0\r\n\r\n")  # 1.0 closes by default
    assert status == 200 and headers["Connection"] == "close" and json.loads(body) == {"status": "SERVING"}


def test_bad_request_does_not_disturb_the_next(openai_client, stub):
    with pytest.raises(BadRequestError) as caught:
        openai_client.embeddings.create(model="any", input="")
    assert caught.value.status_code == 400 and "empty" in caught.value.message
    reply = openai_client.embeddings.create(model="any", input=["hello"], encoding_format="float")
    np.testing.assert_allclose(reply.data[0].embedding, grpc_vectors(stub, ["hello"])[0], atol=2e-6)
