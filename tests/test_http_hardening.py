"""The HTTP door against hostile clients: malformed headers are refused 400 without quoting them
(a header can carry an API key)."""
from __future__ import annotations

import json
import pathlib
import socket

import pytest

from tests.conftest import ServerProcess
from tests.test_http_limits import read_all

SECRET = "s3cr3t-0123456789"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    log = tmp_path_factory.mktemp("guarded") / "server.log"
    srv = ServerProcess("--api-key", SECRET, log=str(log)).start()
    yield srv
    assert srv.terminate() == 0


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        return read_all(sock)[0]


@pytest.mark.parametrize("request_bytes", [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\0\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization Bearer %s\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Api-Key: %s\r\r\n\r\n",
    b"GET /v1/models?key=%s\0 HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["nul-in-value", "no-colon", "cr-in-value", "nul-in-target"])
def test_a_malformed_header_is_400_and_never_quoted(guarded, request_bytes):
    received = exchange(guarded.http_port, request_bytes % SECRET.encode())
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), received
    assert SECRET.encode() not in received and b"Bearer" not in body, received
    message = json.loads(body)["error"]["message"]
    assert message.startswith("malformed request: ") and ("header" in message or "request line" in message), message
    assert SECRET not in pathlib.Path(guarded.log).read_text(errors="replace")
