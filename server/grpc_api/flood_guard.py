"""Closing gRPC connections that flood the frontend with HTTP/2 frames that carry no calls.

gRPC core bounds what such a connection holds (--grpc-max-streams-per-connection refuses the
streams of a rapid reset; its ping policy answers a PING flood with GOAWAY too_many_pings) but
does not close it: its frames go on being parsed and answered on the frontend's one poller
thread, where every other connection of the frontend waits behind them. No gRPC setting closes a
connection for that, so the frontend does it from outside gRPC.

The measure is a connection's bytes that no call explains. The service credits each peer with
the bytes of every message it reads and answers, plus a per-message allowance for HTTP/2's own
framing (server/grpc_api/service.py `metered`). Every TICK_S the guard reads the kernel's byte counters of
each TCP connection on the gRPC port (TCP_INFO, through a duplicate of gRPC's descriptor):
what each connection sent and received beyond its peer's credit goes into two buckets that drain
at the limits' rate. A connection whose buckets are both over their limits, and whose bytes the
server answered in more than a small share, is reset (abort()) and logged with its peer's
address. Every condition must hold: a client uploading large messages, or whose large calls
end by their deadline before the server has read them, has many unexplained bytes in, but the
server sends it almost nothing back for them; a flood of resets or pings makes the server answer
every frame (RST_STREAM, PING ack). Calls whose deadline passes before gRPC hands them over are
not credited, and a frontend overloaded enough has many; but it still hands some over, so a
connection is closed only once none of its calls has reached the service for CALM_S. That also
means a flood that sends one real call a second is not closed: what bounds it then is the stream
bound. Unix sockets are not watched: their clients are local.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass

from pollen.common.throttled_log import ThrottledLog

log = logging.getLogger("pollen.flood_guard")

TICK_S = 0.1
# Unexplained bytes a connection may receive per second (and at once: the bucket's size); the
# server may send it a quarter of that. A flood of resets makes the server send about 13 bytes
# per 50 received; a flood of pings 17 per 17.
IN_BYTES_PER_S = 128 << 10
OUT_SHARE = 4
# ... and must have been answered more than this share of its unexplained bytes: a flood makes
# the server answer nearly every frame (a RST_STREAM for each stream refused, an ack for each
# ping), while the bytes of large calls that end before the server reads them (their deadline
# passed in flight) are answered only with flow control's frames, a smaller share than this.
ANSWERED_SHARE = 16
# Credit per message read or answered, over its own bytes: a call's HEADERS (HPACK-compressed
# after the first), the message's DATA frame and length prefix, trailers, WINDOW_UPDATEs.
FRAMING_BYTES = 1024
# ... and no message of its calls may have reached the service for this long: a client whose
# calls die by their deadline before the service sees them (an overloaded frontend) still has
# some that do, while a flood's streams never get that far.
CALM_S = 1.0
# What a connection may be credited ahead of its bytes (answers handed to gRPC and not yet sent,
# and the framing allowance it did not use): what a client that has made calls may flood with
# before it is closed.
MAX_AHEAD_BYTES = 8 << 20
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked at offset 120, tcpi_bytes_received at 128.
_TCP_INFO = struct.Struct("120xQQ")
_LOG_INTERVAL_S = 10.0


_libc = ctypes.CDLL(None, use_errno=True)
_UNSPEC = bytes(16)  # a struct sockaddr of family AF_UNSPEC (0)


def abort(sock: socket.socket) -> None:
    """Reset the TCP connection under `sock` and every descriptor of it (gRPC's too): connect() to
    AF_UNSPEC disconnects a TCP socket (RST to the peer). A shutdown() alone is not enough: gRPC
    core, once it has sent GOAWAY, may never read the end of the stream nor close its descriptor,
    and the peer's bytes would go on filling the socket's buffer."""
    if _libc.connect(sock.fileno(), _UNSPEC, len(_UNSPEC)) != 0:
        sock.shutdown(socket.SHUT_RDWR)


def peer_key(peer: str) -> tuple[str, int] | None:
    """gRPC's peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5") as (host, port); None for unix peers."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = address.rpartition(":")
    return host.strip("[]").removeprefix("::ffff:"), int(port)


@dataclass(slots=True)
class Connection:
    sent: int          # the kernel's counters at the last tick
    received: int
    credit_in: int     # the peer's credits at the last tick
    credit_out: int
    debt_in: float = 0.0   # unexplained bytes, drained at the limits' rate
    debt_out: float = 0.0
    last_call: float = float("-inf")  # when a message of this connection last reached the service


class FloodGuard:
    def __init__(self, port: int, in_bytes_per_s: int = IN_BYTES_PER_S):
        self.port = port
        self.limits = (in_bytes_per_s, in_bytes_per_s // OUT_SHARE)
        self.credits: dict[str, list[int]] = {}  # gRPC peer string -> [bytes in, bytes out]
        self.connections: dict[tuple[int, tuple[str, int]], Connection] = {}
        self.closed = 0
        self._log = ThrottledLog(log, _LOG_INTERVAL_S)

    def read(self, peer: str, nbytes: int) -> None:
        """A message of `nbytes` read from `peer` (gRPC's peer string)."""
        credit = self.credits.get(peer)
        if credit is None:
            credit = self.credits[peer] = [0, 0]
        credit[0] += nbytes + FRAMING_BYTES

    def answered(self, peer: str, nbytes: int) -> None:
        """An answer of `nbytes` (or a call's end) handed to gRPC for `peer`."""
        credit = self.credits.get(peer)
        if credit is None:
            credit = self.credits[peer] = [0, 0]
        credit[1] += nbytes + FRAMING_BYTES

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            try:
                self.check(now - last, now)
            except Exception:  # noqa: BLE001 - the guard must never take the frontend down
                log.exception("the flood guard's check failed")
            last = now

    def check(self, elapsed: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        credits = {peer_key(p): c for p, c in self.credits.items() if p.startswith("ipv")}
        seen = {}
        for fd, sock in self._sockets():
            with sock:
                host, port = sock.getpeername()[:2]
                peer = (host.removeprefix("::ffff:"), port)
                key = (fd, peer)
                sent, received = _TCP_INFO.unpack_from(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256))
                credit_in, credit_out = credits.get(peer, (0, 0))
                conn = self.connections.get(key)
                if conn is None:
                    conn = Connection(sent, received, credit_in, credit_out)
                if credit_in > conn.credit_in:
                    conn.last_call = now
                conn.debt_in = self._debt(conn.debt_in, received - conn.received, credit_in - conn.credit_in,
                                          self.limits[0] * elapsed)
                conn.debt_out = self._debt(conn.debt_out, sent - conn.sent, credit_out - conn.credit_out,
                                           self.limits[1] * elapsed)
                conn.sent, conn.received, conn.credit_in, conn.credit_out = sent, received, credit_in, credit_out
                if (conn.debt_in > self.limits[0] and conn.debt_out > self.limits[1]
                        and conn.debt_out * ANSWERED_SHARE > conn.debt_in and now - conn.last_call > CALM_S):
                    abort(sock)
                    self.closed += 1
                    self._log.warning("closed the gRPC connection from %s:%d: it sent %d bytes and was answered %d "
                                      "that carried no calls (an HTTP/2 flood)", peer[0], peer[1],
                                      int(conn.debt_in), int(conn.debt_out))
                    continue
                seen[key] = conn
        self.connections = seen
        live = {key[1] for key in seen}
        for peer in [p for p in self.credits if not p.startswith("ipv") or peer_key(p) not in live]:
            del self.credits[peer]  # its connection is gone ("" is the peer of a call already ended)

    @staticmethod
    def _debt(debt: float, grew: int, credited: int, drained: float) -> float:
        """The bucket after a tick: what grew beyond the credit goes in, and the limit's rate drains
        what is in; credit ahead of the bytes is kept, up to MAX_AHEAD_BYTES."""
        debt += grew - credited
        return max(0.0, debt - drained) if debt > 0 else max(-MAX_AHEAD_BYTES, debt)

    def _sockets(self):
        """(fd, a duplicate socket) for each connected TCP socket of this process on the gRPC port."""
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue  # closed meanwhile
            try:
                if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                        and sock.getsockname()[1] == self.port):
                    sock.getpeername()  # a listener has none
                    yield fd, sock
                    continue
            except OSError:
                pass
            sock.close()
