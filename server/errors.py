"""The one exception that becomes a gRPC status (unary) or a per-message error (stream)."""
from __future__ import annotations

import grpc


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)

