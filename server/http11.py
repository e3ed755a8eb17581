"""A small, strict HTTP/1.1 server on asyncio streams: what the HTTP door needs and no more.

What it does: persistent connections (HTTP/1.1 by default, HTTP/1.0 with `Connection:
keep-alive`), requests answered one at a time per connection in arrival order (so pipelined
requests work), bodies framed by Content-Length only, `Expect: 100-continue`, and a graceful stop.

What it refuses, always with a response before closing:
- a head (request line + headers) over `max_head_bytes`: 431;
- a body announced over `max_body_bytes`: 413, without reading it;
- `Transfer-Encoding` (chunked uploads): 411, since we frame bodies by length only (a request
  with neither header has an empty body, as RFC 9112 says);
- malformed request lines, header lines, conflicting Content-Lengths: 400; other versions: 505.

After an error the connection closes with a "lingering close": we stop writing, then read and
discard what the client still sends for a moment, so the kernel does not answer the unread
bytes with a reset that would destroy our error response before the client reads it.

Routing and bodies are the handler's business (server/http_door.py); this file only speaks HTTP.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("pollen.http")

_REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 411: "Length Required", 413: "Content Too Large", 415: "Unsupported Media Type",
    429: "Too Many Requests", 431: "Request Header Fields Too Large", 499: "Client Closed Request",
    500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
    504: "Gateway Timeout", 505: "HTTP Version Not Supported",
}
_TOKEN_CHARS = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


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
    def __init__(self, handler: Handler, error_response: ErrorBody, *, max_head_bytes: int = 16 << 10,
                 max_body_bytes: int, idle_timeout: float = 75.0, read_timeout: float = 30.0):
        self.handler = handler
        self.error_response = error_response  # builds the body of protocol errors (4xx), in the door's format
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = max_body_bytes
        self.idle_timeout = idle_timeout      # how long a kept-alive connection may wait for its next request
        self.read_timeout = read_timeout      # how long one request's head and body may take to arrive
        self._server: asyncio.base_events.Server | None = None
        self._connections: dict[asyncio.Task, bool] = {}  # connection task -> busy with a request
        self._stopping = False
        self._draining = False

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        # The stream's limit bounds readuntil(): a head over it raises LimitOverrunError (431).
        self._server = await asyncio.start_server(self._serve_connection, host.strip("[]"), port,
                                                  limit=self.max_head_bytes, reuse_address=True,
                                                  reuse_port=reuse_port)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    def drain(self) -> None:
        """Shutting down soon: keep answering, but close each connection after its answer
        (Connection: close), so clients reconnect to a server that stays."""
        self._draining = True

    async def stop(self, grace: float) -> None:
        """Stop accepting, close idle connections now, let busy ones finish (up to `grace` s)."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for task, busy in list(self._connections.items()):
            if not busy:
                task.cancel()
        if self._connections:
            _, late = await asyncio.wait(set(self._connections), timeout=grace)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections[task] = False
        try:
            await self._requests(reader, writer, task)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or we are stopping: nothing left to answer
        except Exception:  # a bug in this file: log it, drop the connection, keep the server
            log.exception("HTTP connection failed")
        finally:
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _requests(self, reader, writer, task) -> None:
        # While a request is handled we keep reading one byte ahead: EOF there means the client
        # left, and its request is cancelled rather than computed for nobody; a byte is the start
        # of a pipelined request, kept for the next turn.
        next_byte: asyncio.Future | None = None
        try:
            while not self._stopping:
                try:
                    if next_byte is None:
                        next_byte = asyncio.ensure_future(reader.read(1))
                    # Waiting for the first byte of the next request does not count as busy.
                    first = await asyncio.wait_for(next_byte, self.idle_timeout)
                    next_byte = None
                    if not first:
                        return  # clean close by the client between requests
                    self._connections[task] = True
                    async with asyncio.timeout(self.read_timeout):
                        request, keep_alive = await self._read_request(first, reader, writer)
                except TimeoutError:
                    if self._connections[task]:  # stalled mid-request: say so; idle ones just close
                        await self._fail(writer, reader, ProtocolError(408, "the request did not arrive in time"))
                    return
                except ProtocolError as exc:
                    await self._fail(writer, reader, exc)
                    return
                next_byte = asyncio.ensure_future(reader.read(1))
                response = await self._handle(request, next_byte)
                if response is None:
                    return  # the client closed the connection: nobody to answer
                keep_alive = keep_alive and not (self._stopping or self._draining)
                writer.write(_encode(response, keep_alive))
                await writer.drain()
                self._connections[task] = False
                if not keep_alive:
                    return
        finally:
            if next_byte is not None:
                next_byte.cancel()

    async def _handle(self, request: Request, next_byte: asyncio.Future) -> Response | None:
        handling = asyncio.ensure_future(self.handler(request))
        try:
            await asyncio.wait({handling, next_byte}, return_when=asyncio.FIRST_COMPLETED)
            if not handling.done() and (next_byte.exception() is not None or next_byte.result() == b""):
                return None
            return await handling
        except Exception:
            log.exception("HTTP handler failed on %s %s", request.method, request.path)
            return self.error_response(500, "internal error (logged by the server)")
        finally:
            handling.cancel()  # no-op once done; stops the work when the client left or we stop

    async def _read_request(self, first: bytes, reader, writer) -> tuple[Request, bool]:
        try:
            head = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise ProtocolError(431, f"the request line and headers exceed {self.max_head_bytes} bytes") from None
        if len(head) > self.max_head_bytes:
            raise ProtocolError(431, f"the request line and headers exceed {self.max_head_bytes} bytes")
        lines = head[:-4].split(b"\r\n")
        method, target, version = _request_line(lines[0])
        headers = _headers(lines[1:])
        if "host" not in headers and version == "HTTP/1.1":
            raise ProtocolError(400, "HTTP/1.1 requests need a Host header")
        connection = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = ("close" not in connection) if version == "HTTP/1.1" else ("keep-alive" in connection)
        if "transfer-encoding" in headers:
            raise ProtocolError(411, "Transfer-Encoding (chunked) bodies are not accepted; send Content-Length")
        length = _content_length(headers.get("content-length")) or 0
        if length > self.max_body_bytes:
            raise ProtocolError(413, f"the body has {length} bytes, over the limit of {self.max_body_bytes} "
                                     "(--max-request-bytes); split the request")
        if length and headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await reader.readexactly(length) if length else b""
        path, _, query = target.partition("?")
        return Request(method, path, query, headers, body), keep_alive

    async def _fail(self, writer, reader, exc: ProtocolError) -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(_encode(self.error_response(exc.status, exc.message), keep_alive=False))
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            # Lingering close: discard what the client still sends (say, the body of a 413) for a
            # moment, so closing does not reset the connection before it reads our answer.
            with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError):
                async with asyncio.timeout(2.0):
                    while await reader.read(1 << 16):
                        pass


def _request_line(line: bytes) -> tuple[str, str, str]:
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[0] or not set(parts[0]) <= _TOKEN_CHARS or not parts[1]:
        raise ProtocolError(400, "malformed request line")
    method, target, version = (p.decode("latin-1") for p in parts)
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise ProtocolError(505, f"{version!r} is not supported; speak HTTP/1.1")
    if not target.startswith("/"):
        raise ProtocolError(400, "the request target must be a path starting with /")
    return method, target, version


def _headers(lines: list[bytes]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        # RFC 9112: no whitespace before the colon, no obsolete line folding.
        if not colon or not name or not set(name) <= _TOKEN_CHARS:
            raise ProtocolError(400, f"malformed header line {line[:80]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


def _content_length(value: str | None) -> int | None:
    if value is None:
        return None
    # Repeated headers arrive joined with ", "; equal repeats are allowed, different ones are not.
    values = {v.strip() for v in value.split(",")}
    if len(values) != 1 or not (v := values.pop()).isdigit() or not v.isascii():
        raise ProtocolError(400, f"invalid Content-Length {value!r}")
    return int(v)


def _encode(response: Response, keep_alive: bool) -> bytes:
    head = [f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Unknown')}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            "Connection: keep-alive" if keep_alive else "Connection: close"]
    head += [f"{k}: {v}" for k, v in response.headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body
