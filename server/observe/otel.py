"""A span per embedding request, exported over OTLP (imported only with --otlp-endpoint: see
server/observe/tracing.py).

Every Embed call, EmbedStream message and POST /v1/embeddings passes through
`EmbedderService.embed`; with a tracer it runs inside `RequestTracer.trace`, which opens a
SERVER span whose parent is the trace context the client sent (W3C `traceparent` in gRPC metadata
or an HTTP header, read by the global propagator: tracecontext and baggage unless OTEL_PROPAGATORS
says otherwise). The span's attributes:

    pollen.door            grpc or http
    pollen.tokenize_us     from the call's start to its admission: checks and tokenization
    pollen.queue_us        the answer's timing.queue_us: admission to the start of its last batch
    pollen.inference_us    the answer's timing.inference_us: its first batch's start to its last's end
    pollen.texts, pollen.tokens, pollen.dims
    pollen.outcome         ok, or the status name (INVALID_ARGUMENT, CANCELLED, ...)
    rpc.* / http.*         which call it was

The provider samples as the SDK's defaults and OTEL_TRACES_SAMPLER say (parent-based: a client's
unsampled traceparent is not recorded), batches spans on a thread of its own (OTEL_BSP_* tune it)
and flushes them when the process exits. service.name is OTEL_SERVICE_NAME, else "pollen".
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

import grpc
from opentelemetry import propagate
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from pollen.common.errors import RequestError, cut
from pollen.common.throttled_log import ThrottledLog
from pollen.v1 import embedder_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Embedder"].full_name
# Statuses that are the server's fault: their spans are marked ERROR (OpenTelemetry's gRPC server
# convention); a refused request keeps the status UNSET and says why in pollen.outcome.
SERVER_FAULTS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
                 grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}

# The propagators warn for each malformed tracestate or baggage header a client sends, quoting it.
# That is the client's business: such records become one throttled line that quotes nothing.
PROPAGATION_LOGGERS = ("opentelemetry.baggage.propagation", "opentelemetry.trace.span",
                       "opentelemetry.trace.propagation.tracecontext")


class QuietPropagation(logging.Filter):
    def __init__(self):
        super().__init__()
        self.log = ThrottledLog(logging.getLogger("pollen.otel"), 10.0)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING:
            return True
        self.log.warning("ignored a malformed trace context header (tracestate or baggage) from a client")
        return False


# gRPC's invocation_metadata (called only when tracing), or HTTP's headers (lower-case names).
Headers = Callable[[], Iterable[tuple[str, str | bytes]]] | Mapping[str, str] | None


def exporter_for(endpoint: str) -> SpanExporter:
    """The OTLP exporter for `endpoint` (its scheme picks the transport: server/observe/tracing.py)."""
    scheme, rest = endpoint.split("://", 1)
    if scheme in ("grpc", "grpcs"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=rest.rstrip("/"), insecure=scheme == "grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    host, slash, path = rest.partition("/")
    url = endpoint if path.strip("/") else f"{scheme}://{host}/v1/traces"
    return HttpExporter(endpoint=url)


def carrier_of(headers: Headers) -> Mapping[str, str]:
    if headers is None:
        return {}
    if isinstance(headers, Mapping):
        return headers
    return {key: value for key, value in headers() if isinstance(value, str)}  # -bin values are bytes


class RequestSpan:
    """One request's span, with the clock its tokenize time is measured on."""

    __slots__ = ("span", "started_ns")

    def __init__(self, span, started_ns: int):
        self.span, self.started_ns = span, started_ns

    def admitted(self) -> None:
        """Admission (checks and tokenization) is done: the request goes to the workers."""
        self.span.set_attribute("pollen.tokenize_us", (time.monotonic_ns() - self.started_ns) // 1000)

    def answered(self, response) -> None:
        """An EmbedResponse (its rows and dims), a RerankResponse or a ClassifyResponse (its results)."""
        figures = {"pollen.texts": response.rows, "pollen.dims": response.dims} if isinstance(
            response, pb.EmbedResponse) else {"pollen.results": len(response.results)}
        self.span.set_attributes({
            **figures, "pollen.outcome": "ok", "pollen.tokens": response.usage.prompt_tokens,
            "pollen.queue_us": response.timing.queue_us, "pollen.inference_us": response.timing.inference_us})
        self.span.end()

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, RequestError):
            code, message = exc.code, exc.message
        elif isinstance(exc, Exception):
            code, message = grpc.StatusCode.INTERNAL, repr(exc)
            self.span.record_exception(exc)
        else:  # CancelledError: the client left, or the server stops
            code, message = grpc.StatusCode.CANCELLED, "cancelled"
        self.span.set_attribute("pollen.outcome", code.name)
        if code in SERVER_FAULTS:
            self.span.set_status(Status(StatusCode.ERROR, message))
        self.span.end()


class RequestTracer:
    """A frontend process's tracer provider and exporter, and the spans of its requests."""

    def __init__(self, endpoint: str, frontend: int):
        resource = Resource.create({"pollen.frontend": frontend})
        if resource.attributes.get(SERVICE_NAME, "").startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "pollen"}))
        self.provider = TracerProvider(resource=resource)  # flushes and shuts down at exit
        self.provider.add_span_processor(BatchSpanProcessor(exporter_for(endpoint)))
        self.tracer = self.provider.get_tracer("pollen.server")
        self.propagator = propagate.get_global_textmap()
        quiet = QuietPropagation()
        for name in PROPAGATION_LOGGERS:
            logging.getLogger(name).addFilter(quiet)

    def start(self, request, door: str, headers: Headers, method: str, route: str = "/v1/embeddings",
              task: str = "embed") -> RequestSpan:
        started_ns = time.monotonic_ns()
        parent = self.propagator.extract(carrier_of(headers))
        if door == "grpc":
            name = f"{SERVICE}/{method}"
            attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method}
            if request.id:
                attributes["pollen.request_id"] = cut(request.id)  # the stream message's id
        else:
            name = f"POST {route}"
            attributes = {"http.request.method": "POST", "http.route": route}
        attributes["pollen.door"] = door
        attributes["pollen.task"] = task
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
        return RequestSpan(span, started_ns)

    async def trace(self, counted, request, door: str, headers: Headers, method: str, route: str = "/v1/embeddings",
                    task: str = "embed", **kwargs):
        """`counted(request, door, span=..., **kwargs)` (the service's embed, rerank or classify)
        inside a span."""
        span = self.start(request, door, headers, method, route, task)
        try:
            response = await counted(request, door, span=span, **kwargs)
        except BaseException as exc:
            span.failed(exc)
            raise
        span.answered(response)
        return response

    def shutdown(self) -> None:
        """Export what is left and stop the exporter (also done at process exit)."""
        self.provider.shutdown()
