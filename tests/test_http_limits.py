"""The HTTP door's bounds under abuse: clients that never read their answers are reset within
--http-write-timeout, a connection past --http-max-connections takes the slot of the idlest one
(or is refused, when every one is busy) while gRPC and the rest go on, and the open-files limit is
raised at start and checked in the config."""
from __future__ import annotations

import fcntl
import http.client
import json
import resource
import socket
import struct
import subprocess
import termios
import time

import grpc
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import POLLEN, ServerProcess, vectors

CAP = 6
WRITE_TIMEOUT_S = 2.0
TCP_CLOSE = 7  # tcp_info.tcpi_state


@pytest.fixture(scope="module")
def limited():
    # Start under a low soft open-files limit, which the server raises to the hard one.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        srv = ServerProcess("--http-max-connections", str(CAP), "--http-write-timeout", str(WRITE_TIMEOUT_S)).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
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


def test_past_the_cap_the_idlest_connection_makes_room_and_busy_ones_are_kept(limited):
    held = [http.client.HTTPConnection("127.0.0.1", limited.http_port, timeout=30) for _ in range(CAP)]
    assert [get_health(c) for c in held] == [200] * CAP  # now CAP idle keep-alive connections
    assert [get_health(c) for c in held[1:]] == [200] * (CAP - 1)  # held[0] is now the idlest
    fresh = http.client.HTTPConnection("127.0.0.1", limited.http_port, timeout=30)
    assert get_health(fresh) == 200  # a new client is answered: the idlest connection made room
    held[0].sock.settimeout(10)
    assert held[0].sock.recv(1) == b""  # closed by the server, quietly (FIN)
    held[0].close()
    assert [get_health(c) for c in held[1:]] == [200] * (CAP - 1)  # the others are served
    for conn in held + [fresh]:
        conn.close()
    # Connections that are answering (here: lingering after a 400) are not closed to make room:
    # past the cap a new one is refused 503 at once.
    busy = []
    for _ in range(CAP):
        sock = socket.create_connection(("127.0.0.1", limited.http_port), timeout=30)
        sock.sendall(b"NOT HTTP\r\n\r\n")
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 400 ")
        busy.append(sock)
    with socket.create_connection(("127.0.0.1", limited.http_port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        received, _ = read_all(sock)
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"Connection: close" in head, received
    assert b"--http-max-connections" in payload and b"Retry-After: 1" in head
    with grpc.insecure_channel(limited.listen) as channel:  # and gRPC is not starved
        reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["still fine"]), timeout=30)
    assert vectors(reply).shape == (1, 384)
    for sock in busy:
        sock.close()
    deadline = time.monotonic() + 10
    while True:  # the freed places are taken by the next connection, once the server has seen the close
        fresh = http.client.HTTPConnection("127.0.0.1", limited.http_port, timeout=30)
        try:
            if get_health(fresh) == 200:
                break
        except (ConnectionError, http.client.HTTPException):
            pass
        assert time.monotonic() < deadline, "a connection under the cap was refused"
        fresh.close()
        time.sleep(0.1)
    fresh.close()


def test_the_soft_open_files_limit_is_raised_to_the_hard_one(limited):
    with open(f"/proc/{limited.pid}/limits") as f:
        soft, hard = next(line.split()[3:5] for line in f if line.startswith("Max open files"))
    assert soft == hard == str(resource.getrlimit(resource.RLIMIT_NOFILE)[1])


def test_a_cap_over_the_open_files_limit_is_refused_at_start():
    from pollen.server.config import FD_RESERVE, ServeConfig, open_files_limit

    room = open_files_limit() - FD_RESERVE
    assert ServeConfig.from_args([], environ={}).http_max_connections == min(1024, room)
    assert ServeConfig.from_args(["--http-max-connections", str(room)], environ={}).http_max_connections == room
    with pytest.raises(ValueError, match="--http-max-connections"):
        ServeConfig.from_args(["--http-max-connections", str(room + 1)], environ={})
    done = subprocess.run([POLLEN, "serve", "--http-max-connections", str(room + 1)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "does not fit under the open-files limit" in done.stderr
