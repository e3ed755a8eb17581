"""Status codes as numbers (google.rpc.Code, as records and EmbedResponse.error.code carry them)
and the messages of requests dropped before the model: one definition for the worker, the
frontend and the client."""
from __future__ import annotations

import grpc

# The numbers a worker answers with (shared_mem/records.py).
OK, CANCELLED, DEADLINE_EXCEEDED, INTERNAL = 0, 1, 4, 13

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

DEADLINE_PASSED = "the deadline passed before the request reached the model"
CANCELLED_BEFORE_MODEL = "the request was cancelled before it reached the model"


def code_of(number: int, unknown: grpc.StatusCode = grpc.StatusCode.UNKNOWN) -> grpc.StatusCode:
    """The grpc.StatusCode of a google.rpc.Code number (`unknown` for a number gRPC does not define)."""
    return _BY_NUMBER.get(number, unknown)


def number_of(code: grpc.StatusCode) -> int:
    """The google.rpc.Code number of a grpc.StatusCode."""
    return code.value[0]
