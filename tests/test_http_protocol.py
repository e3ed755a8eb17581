"""Small protocol faults of the HTTP door: uint32 fields past their range, HEAD, and the parts of
HTTP/1.1 that h11 and our protocol share between them (100-continue, a head that arrives in
pieces)."""
from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from pollen.server.http_api.door import Rejected, to_embed_request
from pollen.server.http_api.http11 import Request
from tests.test_http_door import assert_openai_error, post, raw_exchange

UINT32_PAST = 2**32


@pytest.mark.parametrize("field", ["dimensions", "max_tokens", "timeout_ms"])
def test_uint32_fields_past_their_range_are_400_naming_the_field(server, field):
    body = {"input": "x", field: UINT32_PAST}
    with pytest.raises(Rejected) as caught:
        to_embed_request(Request("POST", "/v1/embeddings", "", {}, json.dumps(body).encode()))
    assert caught.value.param == field
    status, payload = post(server, body)
    assert status == 400, payload
    assert_openai_error(payload, f"$.{field}", "4294967295")
    assert payload["error"]["param"] == field


def test_head_is_answered_as_get_without_a_body(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("GET", "/health")
    get = conn.getresponse()
    get_body = get.read()
    conn.request("HEAD", "/health")
    head = conn.getresponse()
    assert head.status == 200 and head.read() == b""
    assert head.getheader("Content-Length") == str(len(get_body))
    conn.request("HEAD", "/v1/embeddings")
    refused = conn.getresponse()
    assert refused.status == 405 and refused.read() == b"" and refused.getheader("Allow") == "POST"
    conn.request("GET", "/health")  # the same connection: no stray body bytes were sent
    assert conn.getresponse().read() == get_body
    conn.close()


def test_expect_100_continue(server):
    body = json.dumps({"input": "hello"}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_long_head_arriving_in_pieces_is_431(server):
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
        for _ in range(20):
            sock.sendall(b"X-Filler: " + b"y" * 1000 + b"\r\n")
            time.sleep(0.01)
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
    assert received.startswith(b"HTTP/1.1 431 ")


def test_http10_is_answered_and_closed(server):
    status, headers, body = raw_exchange(server, b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert status == 200 and headers["Connection"] == "close" and json.loads(body) == {"status": "SERVING"}
