"""HTTP/1.1 for the HTTP door: h11 reads and writes the wire, an asyncio.Protocol drives it, and
this file keeps the door's policies around it. Routes and bodies are the handler's business
(server/http_api/door.py); this file knows nothing of embeddings.

What it does: persistent connections (HTTP/1.1; an HTTP/1.0 request is answered, then the
connection closes), requests answered one at a time per connection in arrival order (so pipelined
requests work), bodies framed by Content-Length only, `Expect: 100-continue`, and a graceful stop.

What it refuses, always with a response before closing:
- a head (request line + headers) over `max_head_bytes`: 431;
- a body announced over `max_body_bytes`: 413, before a byte of it is read;
- `Transfer-Encoding` (chunked uploads): 411, since we frame bodies by length only (a request
  with neither header has an empty body, as RFC 9112 says);
- malformed request lines and headers, conflicting Content-Lengths, a target that is not a path:
  400; versions other than 1.0 and 1.1: 505;
- a request that has begun but not arrived whole within `read_timeout`: 408;
- an answer over one chunk (`write_buffer_bytes`) that would take the bytes of answers not yet
  handed to the kernel, over all connections, past `max_unread_bytes`: 503 with Retry-After in its
  place (the next request on the connection is read as usual);
- a connection past `max_connections` open ones, when every open one is in the middle of a request
  (or answering one): 503 as soon as it is accepted, then closed.

Error messages never quote a header: one can carry credentials (a malformed header line or request
line is refused in h11's words, without the line).

Connection slots: when all `max_connections` are taken, a new connection takes the slot of one
that is neither handling a request nor writing its answer: the oldest of those that have sent
nothing yet, else the one heard from least recently (kept alive between requests, or with a
request arriving). So idle sockets cannot keep new clients, a liveness probe on /health among
them, from being answered, and a client that has been served keeps its connection while sockets
that have never said a word remain to be closed.

After an error the connection closes with a "lingering close": we stop writing, then read and
discard what the client still sends for up to LINGER_S, so the kernel does not answer the unread
bytes with a reset that would destroy our error response before the client reads it.

Timeouts: `first_byte_timeout` for a new connection's first byte and `idle_timeout` between
requests (past either the connection closes quietly), `read_timeout` for one
request to arrive (408), `write_timeout` for an answer the client does not read: the transport
pauses us when its buffer passes its high-water mark (`write_buffer_bytes`), and a connection
whose buffer has not drained within `write_timeout` is reset.

Memory per connection is bounded. Reading: one request (its head up to `max_head_bytes`, its
body up to `max_body_bytes`), plus HELD_BYTES of pipelined requests after it (and the socket read
that crosses that mark), past which reading pauses until the request is answered. Writing: the
answer being written, plus at most two chunks of `write_buffer_bytes` queued in the transport:
the answer goes to the transport a chunk at a time while its buffer is under the high-water
mark, and the next pipelined request is not read until the buffer drains. The answers not yet
handed to the kernel are bounded over all connections by `max_unread_bytes` (beside the chunks in
the transports' buffers, two per connection at most).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import re
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import h11

from pollen.common.errors import cut

log = logging.getLogger("pollen.http")

LINGER_S = 2.0
HELD_BYTES = 64 << 10

_REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 411: "Length Required", 413: "Content Too Large", 415: "Unsupported Media Type",
    422: "Unprocessable Content", 424: "Failed Dependency", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 499: "Client Closed Request",
    500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
    504: "Gateway Timeout", 505: "HTTP Version Not Supported",
}
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets and drops the unsent bytes


@dataclass(slots=True)
class Request:
    method: str
    path: str                   # without the query string
    query: str
    headers: dict[str, str]     # lower-case names; repeated headers joined with ", "
    body: bytes


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class ProtocolError(Exception):
    """The request cannot be read; answer `status` and close the connection."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


Handler = Callable[[Request], Awaitable[Response]]
ErrorBody = Callable[[int, str], Response]


class HttpServer:
    def __init__(self, handler: Handler, error_response: ErrorBody, *, max_body_bytes: int,
                 max_connections: int = 1024, max_head_bytes: int = 16 << 10, idle_timeout: float = 75.0,
                 read_timeout: float = 30.0, write_timeout: float = 30.0, write_buffer_bytes: int = 64 << 10,
                 first_byte_timeout: float = 5.0, max_unread_bytes: int = 256 << 20):
        self.handler = handler
        self.error_response = error_response  # builds the body of protocol errors (4xx), in the door's format
        self.max_body_bytes = max_body_bytes
        self.max_connections = max_connections
        self.max_head_bytes = max_head_bytes
        self.first_byte_timeout = first_byte_timeout  # how long a new connection may wait to send a byte
        self.idle_timeout = idle_timeout      # how long a kept-alive connection may wait for its next request
        self.read_timeout = read_timeout      # how long one request's head and body may take to arrive
        self.write_timeout = write_timeout    # how long an answer may sit unread over the buffer's high-water mark
        self.write_buffer_bytes = write_buffer_bytes
        self.max_unread_bytes = max_unread_bytes
        self.unread = 0  # bytes of answers queued at connections, not yet handed to their transports
        self.connections: set[_Connection] = set()
        # The connections a new one may close to take their slot, in the order they are closed:
        # the silent ones (no byte yet) oldest first, then the quiet ones (neither handling a
        # request nor writing its answer) least recently heard from first. A dict keeps its order.
        self.silent: dict[_Connection, None] = {}
        self.quiet: dict[_Connection, None] = {}
        self.stopping = False
        self.draining = False  # answering still, but closing each connection after its answer
        self._server: asyncio.AbstractServer | None = None
        self.refusal = _standalone(error_response(
            503, f"the server holds its limit of {max_connections} HTTP connections (--http-max-connections); "
                 "retry later or reuse a connection"))
        self.unread_refusal = error_response(
            503, f"the server holds its limit of {max_unread_bytes:,} bytes of answers that clients have not read "
                 "(--http-unread-bytes); retry later")

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        """Listen; with reuse_port, beside the other frontends on the same address (SO_REUSEPORT)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host.strip("[]"), port,
                                                reuse_address=True, reuse_port=reuse_port)

    def drain(self) -> None:
        """Shutting down soon: keep answering, but close each connection after its answer
        (Connection: close), so clients reconnect to a server that stays."""
        self.draining = True

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def stop(self, grace: float) -> None:
        """Stop accepting, close idle connections now, let busy ones finish (up to `grace` s):
        their answers say `Connection: close`."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if not conn.busy:
                conn.transport.close()
        if self.connections:
            await asyncio.wait({c.closed for c in self.connections}, timeout=grace)
        late = list(self.connections)
        for conn in late:
            conn.abort()
        await asyncio.gather(*(c.closed for c in late), *(c.task for c in late if c.task), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


class _Connection(asyncio.Protocol):
    """One client connection. Its states: waiting for a request (idle timer), reading one (read
    timer), handling it (`task`), writing its answer (`outgoing`, then `draining` until the
    transport's buffer is under its low-water mark; the write timer runs while the transport has
    paused us), lingering after an error. `busy` covers everything from a request's first byte
    until its answer is drained."""

    def __init__(self, server: HttpServer):
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.closed = self.loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.conn: h11.Connection | None = None  # None: refused past the connection cap
        self.busy = False
        self.head_only = False  # the request is HEAD: its answer has no body
        self.request: Request | None = None
        self.body: list[bytes] = []
        self.task: asyncio.Task | None = None
        self.outgoing: collections.deque[bytes | memoryview] = collections.deque()  # the answer's unwritten parts
        self.draining = False
        self.paused = False      # the transport's buffer is over its high-water mark
        self.lingering = False
        self.client_done = False  # the client has half-closed while its answer is being written
        self.held = 0            # bytes received while a request is handled or its answer drained
        self.reading_paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            idle = server.silent or server.quiet
            if not idle:  # every slot is taken by a request or its answer
                transport.write(server.refusal)
                transport.close()
                return
            other = next(iter(idle))
            del idle[other]
            server.connections.discard(other)  # its slot is ours now; its close completes soon
            other.transport.close()
        server.connections.add(self)
        server.silent[self] = None
        transport.set_write_buffer_limits(high=server.write_buffer_bytes)
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=server.max_head_bytes)
        self._set_timer(server.first_byte_timeout, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self.conn is None or self.lingering:
            return  # refused, or discarding what the client still sends after an error
        self.conn.receive_data(data)
        if self.task is not None or self.outgoing or self.draining:
            # A pipelined request: kept for its turn, and reading pauses once too much waits.
            self.held += len(data)
            if self.held > HELD_BYTES and not self.reading_paused:
                self.reading_paused = True
                self.transport.pause_reading()
            return
        if not self.busy:  # the first bytes of a request: it now has read_timeout to arrive whole
            self.busy = True
            self._set_timer(self.server.read_timeout, self._read_timed_out)
        self.server.silent.pop(self, None)
        self.server.quiet.pop(self, None)  # heard from: the last of the quiet ones to be closed
        self.server.quiet[self] = None
        self._next()

    def eof_received(self) -> bool:
        if self.task is not None:
            self.task.cancel()  # the client left while its request was handled: nobody to answer
        elif self.outgoing:
            self.client_done = True  # it has sent all it will: finish this answer, then close
            return True
        return False  # the transport closes (after writing what it holds)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self.timer, self.write_timer):
            if timer is not None:
                timer.cancel()
        if self.task is not None:
            self.task.cancel()
        self.server.unread -= sum(map(len, self.outgoing))
        self.outgoing.clear()
        self.server.connections.discard(self)
        self.server.silent.pop(self, None)
        self.server.quiet.pop(self, None)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True
        self.write_timer = self.loop.call_later(self.server.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        self.paused = False
        self.write_timer.cancel()
        self.write_timer = None
        if self.outgoing:
            self._pump()
        elif self.draining:
            self.draining = False
            self._await_next()

    def abort(self) -> None:
        """Drop the connection now: its handler is cancelled, what is unsent is lost."""
        if self.task is not None:
            self.task.cancel()
        self.transport.abort()

    def _next(self) -> None:
        """Take h11's events until a request is whole (then handle it) or more bytes are needed."""
        while self.task is None and not self.lingering:
            try:
                event = self.conn.next_event()
                if isinstance(event, h11.Request):
                    self._begin(event)
            except h11.RemoteProtocolError as exc:
                self._fail(_refusal_of(exc))
                return
            except ProtocolError as exc:
                self._fail(exc)
                return
            if isinstance(event, h11.Data):
                self.body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch()
            elif event is h11.NEED_DATA or event is h11.PAUSED:
                return

    def _begin(self, event: h11.Request) -> None:
        """Checks on a request's head, made before a byte of its body is read."""
        self.head_only = event.method == b"HEAD"
        # h11 bounds a head that arrives in pieces; one that arrives whole is measured here.
        head = len(event.method) + len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers) + 14
        if head > self.server.max_head_bytes:
            raise ProtocolError(431, f"the request line and headers exceed {self.server.max_head_bytes} bytes")
        if event.http_version not in (b"1.1", b"1.0"):
            raise ProtocolError(505, f"HTTP/{event.http_version.decode()} is not supported; speak HTTP/1.1")
        if not event.target.startswith(b"/"):
            raise ProtocolError(400, "the request target must be a path starting with /")
        headers: dict[str, str] = {}
        for name, value in event.headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if "transfer-encoding" in headers:
            raise ProtocolError(411, "Transfer-Encoding (chunked) bodies are not accepted; send Content-Length")
        length = int(headers.get("content-length", 0))  # h11 has checked it: digits, no conflicting repeats
        if length > self.server.max_body_bytes:
            raise ProtocolError(413, f"the body has {length} bytes, over the limit of {self.server.max_body_bytes} "
                                     "(--max-request-bytes); split the request")
        if length and self.conn.they_are_waiting_for_100_continue:
            self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                          reason=b"Continue")))
        path, _, query = event.target.decode("latin-1").partition("?")
        self.request = Request(event.method.decode("latin-1"), path, query, headers, b"")

    def _dispatch(self) -> None:
        self._cancel_timer()  # the request is whole
        self.server.quiet.pop(self, None)  # its slot is held until the answer is written
        request, self.request = self.request, None
        request.body = b"".join(self.body)
        self.body = []
        self.task = self.loop.create_task(self._respond(request))

    async def _respond(self, request: Request) -> None:
        try:
            response = await self.server.handler(request)
        except Exception:
            log.exception("HTTP handler failed on %s %s", request.method, cut(request.path))
            response = self.server.error_response(500, "internal error (logged by the server)")
        # A cancelled handler (the client left, or the stop's grace ran out) ends here, unanswered.
        self.task = None
        server = self.server
        size = 0 if self.head_only else len(response.body)
        if size > server.write_buffer_bytes and server.unread + size > server.max_unread_bytes:
            response = server.unread_refusal
        try:
            self.outgoing.extend(_encode(self.conn, response, server.stopping or server.draining, self.head_only))
            server.unread += sum(map(len, self.outgoing))
            self._pump()
        except Exception:  # a bug in this file: log it, drop the connection, keep the server
            log.exception("HTTP connection failed")
            self.abort()

    def _pump(self) -> None:
        """Hand the answer to the transport a chunk at a time, while it is not paused: its buffer
        stays within about two chunks, and each chunk must be taken by the client within
        write_timeout (the transport resumes us only once a write has gone out whole)."""
        while self.outgoing and not self.paused:
            batch, room = [], self.server.write_buffer_bytes
            while self.outgoing and room:
                part = self.outgoing.popleft()
                if len(part) > room:
                    part = memoryview(part)
                    self.outgoing.appendleft(part[room:])
                    part = part[:room]
                batch.append(part)
                room -= len(part)
            self.server.unread -= self.server.write_buffer_bytes - room
            self.transport.writelines(batch)  # one system call for the head and a small body
        if not self.outgoing and not self.transport.is_closing():
            self._after_response()

    def _after_response(self) -> None:
        if self.client_done or self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
            self.transport.close()  # no next request (Connection: close, HTTP/1.0, EOF): flush, then close
            return
        self.conn.start_next_cycle()
        if self.paused:  # the next request waits until the client reads this answer
            self.draining = True
            return
        self._await_next()

    def _await_next(self) -> None:
        """Between requests. The next one may already be here (pipelined)."""
        if self.server.stopping:
            self.transport.close()
            return
        self.busy = bool(self.conn.trailing_data[0])
        if self.busy:
            self._set_timer(self.server.read_timeout, self._read_timed_out)
        else:
            self._set_timer(self.server.idle_timeout, self.transport.close)
        self.held = 0
        self.head_only = False
        self.server.quiet[self] = None  # waiting (or reading the next request): its slot may be taken
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.busy:
            self._next()

    def _fail(self, exc: ProtocolError) -> None:
        """Answer a protocol error, then close with a lingering close."""
        self.lingering = True
        self.server.quiet.pop(self, None)
        response = self.server.error_response(exc.status, exc.message)
        try:
            self.transport.writelines(_encode(self.conn, response, True, self.head_only))
        except h11.LocalProtocolError:  # h11 cannot answer in this state: close without a word
            self.transport.close()
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._set_timer(LINGER_S, self.transport.close)

    def _read_timed_out(self) -> None:
        self._fail(ProtocolError(408, "the request did not arrive in time"))

    def _write_timed_out(self) -> None:
        """The client has not read its answer for write_timeout: reset the connection, so that
        neither our buffer nor the kernel's keeps the unread bytes."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        self.abort()

    def _set_timer(self, delay: float, callback) -> None:
        self._cancel_timer()
        self.timer = self.loop.call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


# Where h11's reason quotes the client's bytes (as a bytes or bytearray repr, at its end).
_QUOTED = re.compile(r""":?\s*(?:bytearray\()?b['"].*""", re.DOTALL)


def _refusal_of(exc: h11.RemoteProtocolError) -> ProtocolError:
    """h11's reason for refusing a request, as our status, without the line it quotes: a header
    line or the request line can hold an API key."""
    message = _QUOTED.sub("", str(exc))
    if "Transfer-Encoding" in message:  # h11 frames chunked bodies only; we frame none
        return ProtocolError(411, "Transfer-Encoding bodies are not accepted; send Content-Length")
    if message != str(exc):
        message += " (not quoted: it may hold credentials)"
    return ProtocolError(exc.error_status_hint, f"malformed request: {message}")


def _encode(conn: h11.Connection, response: Response, close: bool, head_only: bool = False) -> list[bytes]:
    """The response as bytes, through h11: it says `Connection: close` whenever it will close
    (asked to, or the request said so, or it was HTTP/1.0); a HEAD answer has no body."""
    headers = [(b"Content-Type", response.content_type.encode("latin-1")),
               (b"Content-Length", b"%d" % len(response.body)),
               (b"Connection", b"close" if close else b"keep-alive")]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()]
    reason = _REASONS.get(response.status, "Unknown").encode("latin-1")
    parts = [conn.send(h11.Response(status_code=response.status, headers=headers, reason=reason))]
    if response.body and not head_only:
        parts += conn.send_with_data_passthrough(h11.Data(data=response.body))
    parts.append(conn.send(h11.EndOfMessage()))
    return parts


def _standalone(response: Response) -> bytes:
    """`response` as bytes for a connection whose request will not be read (refused at accept):
    h11 serializes a response only as the answer to a request, so it answers a stand-in one."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: pollen\r\n\r\n")
    conn.next_event()
    return b"".join(_encode(conn, response, close=True))
