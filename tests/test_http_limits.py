"""The HTTP door's bounds under abuse: clients that never read their answers are reset after
--http-write-timeout."""
from __future__ import annotations

import fcntl
import http.client
import json
import socket
import struct
import termios
import time

import pytest

from tests.conftest import ServerProcess

WRITE_TIMEOUT_S = 2.0
TCP_CLOSE = 7  # tcp_info.tcpi_state


@pytest.fixture(scope="module")
def limited():
    srv = ServerProcess("--http-write-timeout", str(WRITE_TIMEOUT_S)).start()
    yield srv
    assert srv.terminate() == 0


def reset_by_peer(sock: socket.socket) -> bool:
    """The kernel's view of a client socket: closed by a reset (a peer's FIN leaves it CLOSE_WAIT)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == TCP_CLOSE


def queued(sock: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4))[0]


def get_health(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/health")
    reply = conn.getresponse()
    reply.read()
    return reply.status


def read_all(sock: socket.socket) -> tuple[bytes, str]:
    """Everything the server sends until it closes: the bytes and how it ended."""
    received = b""
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        return received, "reset"
    return received, "closed"


def test_clients_that_never_read_are_reset_after_the_write_timeout(limited):
    # 512 texts answered as float JSON: about 4 MB. Two of them pipelined are more than the kernel's
    # socket buffers hold (4 MiB at most here), so the rest waits in the server's own buffer.
    body = json.dumps({"input": [f"text number {i}" for i in range(512)]}).encode()
    request = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    readers = []
    for _ in range(2):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing
        sock.connect(("127.0.0.1", limited.http_port))
        sock.sendall(request + request)
        readers.append(sock)
    # The answers take seconds to compute on two cores; from its first byte on, each may wait
    # unread for WRITE_TIMEOUT_S (give or take the timer's turn on a loaded machine).
    first_byte, reset = {}, {}
    deadline = time.monotonic() + 120
    while len(reset) < len(readers) and time.monotonic() < deadline:
        for i, sock in enumerate(readers):
            if i not in first_byte and queued(sock):
                first_byte[i] = time.monotonic()
            if i not in reset and reset_by_peer(sock):
                reset[i] = time.monotonic()
        time.sleep(0.05)
    assert len(reset) == len(readers), "the server still holds connections whose answers are not read"
    for i, sock in enumerate(readers):
        assert reset[i] - first_byte[i] < WRITE_TIMEOUT_S + 3
        received, ending = read_all(sock)
        sock.close()
        assert len(received) < 1 << 20 and ending == "reset", (len(received), ending)
    assert limited.healthy()
    conn = http.client.HTTPConnection("127.0.0.1", limited.http_port, timeout=60)
    conn.request("POST", "/v1/embeddings", body=body)
    reply = conn.getresponse()
    assert reply.status == 200 and len(json.loads(reply.read())["data"]) == 512  # a client that reads is answered
    conn.close()
