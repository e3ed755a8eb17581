"""The control socket between the supervisor and each frontend or worker process.

One SOCK_SEQPACKET socket pair per child: the supervisor keeps one end, the child inherits the
other. A message is one packet: a small JSON object, with file descriptors beside it when it hands
over a ring pair (shared_mem/ring_pair.py; SCM_RIGHTS, the receiver owns its copies). Requests
and answers travel in the rings; this socket only says which rings to use and when to stop.

Supervisor to frontend:  {"kind": "worker_up", "worker": w, "requests": name, "responses": name}
                          + six fds (each ring's segment, data and space: requests, then responses);
                         {"kind": "worker_down", "worker": w}
Frontend to supervisor:  {"kind": "listening"} once both doors are open; {"kind": "failed", "error": text}
Supervisor to worker:    {"kind": "add_link", "frontend": f, "requests": name, "responses": name} + fds;
                         {"kind": "drop_link", "frontend": f}; {"kind": "stop"}
"""
from __future__ import annotations

import json
import os
import socket

MAX_MESSAGE = 64 << 10
MAX_FDS = 8


def pair() -> tuple[socket.socket, socket.socket]:
    """(supervisor's end, child's end); the child's end is inheritable for pass_fds."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    return ours, theirs


def send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    """Send one message (blocking while the peer's buffer is full: messages are few and small)."""
    data = json.dumps(message).encode()
    blocking = sock.getblocking()
    sock.setblocking(True)
    try:
        socket.send_fds(sock, [data], list(fds))
    finally:
        sock.setblocking(blocking)


def receive(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """The next message and its fds; None when none is waiting. EOFError when the peer is gone."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    except (BlockingIOError, InterruptedError):
        return None
    if not data:
        raise EOFError("the control socket's peer closed it")
    return json.loads(data), fds


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
