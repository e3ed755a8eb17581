"""The one exception that becomes a gRPC status (unary) or a per-message error (stream), and the
one way client input is quoted in an error message."""
from __future__ import annotations

import grpc

# Client input quoted in an error message is cut to this many characters, so that no error answer
# grows with its request (gRPC carries the message in a trailer, which has a size limit of its own).
ECHO_CHARS = 100


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def cut(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` whole when it has at most `limit` characters, else its first `limit` and its length:
    'abc... (cut: 1048576 characters)'."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... (cut: {len(text)} characters)"


def echo(value: str | bytes) -> str:
    """A client's value quoted (repr) for an error message, cut as `cut` does."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    unit = "bytes" if isinstance(value, bytes) else "characters"
    return f"{value[:ECHO_CHARS]!r}... (cut: {len(value)} {unit})"
