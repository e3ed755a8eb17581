"""The switch for request tracing: OpenTelemetry spans when --otlp-endpoint names a collector.

Without the flag, `start` returns None: the service then holds no tracer, no opentelemetry module
is imported, and a request pays one `is None` test. With it, each frontend process starts its own
tracer provider and exporter (server/observe/otel.py): frontends are separate processes, and each sends
the spans of the requests it answers.

The endpoint's scheme picks the OTLP transport:
- `http://host:4318` or `https://...`: OTLP/HTTP (protobuf), POST to `/v1/traces` unless the URL
  has a path of its own;
- `grpc://host:4317`: OTLP/gRPC in plaintext; `grpcs://host:4317`: OTLP/gRPC over TLS.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pollen.server.observe.otel import RequestTracer

SCHEMES = ("http://", "https://", "grpc://", "grpcs://")


def check_endpoint(endpoint: str) -> None:
    """Refuse at start an endpoint no exporter can take, or one the installed packages cannot serve
    (looked up without importing them)."""
    if not endpoint:
        return
    if not endpoint.startswith(SCHEMES) or not endpoint.split("://", 1)[1].strip("/"):
        raise ValueError(f"--otlp-endpoint must be http(s)://host:port[/path] (OTLP/HTTP) or grpc(s)://host:port "
                         f"(OTLP/gRPC), got {endpoint!r}")
    grpc_transport = endpoint.startswith("grpc")
    exporter = "opentelemetry.exporter.otlp.proto." + ("grpc" if grpc_transport else "http")
    for module in ("opentelemetry.sdk", exporter):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise ValueError(f"--otlp-endpoint needs {module}: pip install 'pollen[otel]'")


def start(endpoint: str, frontend: int) -> RequestTracer | None:
    """This frontend's request tracer, exporting to `endpoint`; None (and nothing imported) without one."""
    if not endpoint:
        return None
    from pollen.server.observe.otel import RequestTracer

    return RequestTracer(endpoint, frontend)
