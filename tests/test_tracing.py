"""--otlp-endpoint: a span per embedding request, parented to the caller's W3C traceparent, sent
over OTLP/HTTP and OTLP/gRPC to collectors the tests run; and without the flag, no
opentelemetry import at all."""
from __future__ import annotations

import gzip
import json
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, free_port

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2",
                                    reason="tracing needs the otel extra: pip install 'pollen[otel]'")
trace_grpc = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")

# Spans leave a frontend in batches; a short delay keeps the test short.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


class Collector:
    """The spans that arrived, by trace id (hex), with their resource's attributes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.spans: list[tuple[dict, object]] = []

    def take(self, body: bytes) -> None:
        export = trace_service.ExportTraceServiceRequest.FromString(body)
        with self.lock:
            for resource_spans in export.resource_spans:
                resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self.spans += [(resource, span) for span in scope.spans]

    def wait_for(self, count: int, timeout: float = 20.0) -> list[tuple[dict, object]]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"{len(self.spans)} spans arrived within {timeout} s, expected {count}")

    def of_trace(self, trace_id: str) -> list:
        return [span for _, span in self.spans if span.trace_id.hex() == trace_id]


def value_of(value):
    return getattr(value, value.WhichOneof("value"))


def attributes(span) -> dict:
    return {a.key: value_of(a.value) for a in span.attributes}


@pytest.fixture
def http_collector():
    """A tiny OTLP/HTTP receiver: POST /v1/traces, protobuf bodies."""
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            assert self.path == "/v1/traces", self.path
            collector.take(body)
            reply = trace_service.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    collector.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield collector
    server.shutdown()
    server.server_close()


@pytest.fixture
def grpc_collector():
    """An OTLP/gRPC receiver: the TraceService's Export."""
    collector = Collector()

    class Service(trace_grpc.TraceServiceServicer):
        def Export(self, request, context):
            collector.take(request.SerializeToString())
            return trace_service.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    collector.endpoint = f"grpc://127.0.0.1:{port}"
    yield collector
    server.stop(0)


def traceparent() -> tuple[str, str, str]:
    """A sampled W3C traceparent and its trace and span ids (hex)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def check_timed(span, usage_tokens: int) -> None:
    got = attributes(span)
    assert got["pollen.outcome"] == "ok" and got["pollen.tokens"] == usage_tokens
    assert got["pollen.tokenize_us"] >= 0 and got["pollen.queue_us"] >= 0 and got["pollen.inference_us"] > 0
    assert span.kind == span.SPAN_KIND_SERVER and span.end_time_unix_nano > span.start_time_unix_nano


def post_http(port: int, header: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", method="POST",
                                     data=json.dumps({"input": ["over http"]}).encode(),
                                     headers={"Content-Type": "application/json", "traceparent": header})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.load(reply)


def test_each_request_is_a_span_in_the_callers_trace(http_collector):
    srv = ServerProcess("--otlp-endpoint", http_collector.endpoint, env=FAST_EXPORT).start()
    unary, stream, http, refused = traceparent(), traceparent(), traceparent(), traceparent()
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            reply = stub.Embed(pb.EmbedRequest(texts=["hello", "world"]), metadata=[("traceparent", unary[0])])
            answers = list(stub.EmbedStream(iter([pb.EmbedRequest(id="a", texts=["one"]),
                                                  pb.EmbedRequest(id="b", texts=["two"])]),
                                            metadata=[("traceparent", stream[0])]))
            with pytest.raises(grpc.RpcError) as caught:
                stub.Embed(pb.EmbedRequest(texts=[""]), metadata=[("traceparent", refused[0])])
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stub.Embed(pb.EmbedRequest(texts=["no trace context"]))
        http_reply = post_http(srv.http_port, http[0])
        spans = http_collector.wait_for(6)
    finally:
        assert srv.terminate() == 0
    assert len(spans) == 6  # one per embedding request, nothing else
    (span,) = http_collector.of_trace(unary[1])
    assert span.parent_span_id.hex() == unary[2] and span.name == "pollen.v1.Embedder/Embed"
    check_timed(span, reply.usage.prompt_tokens)
    assert attributes(span)["pollen.texts"] == 2 and attributes(span)["rpc.system"] == "grpc"
    messages = {attributes(s)["pollen.request_id"]: s for s in http_collector.of_trace(stream[1])}
    assert sorted(messages) == ["a", "b"]
    for answer in answers:
        assert messages[answer.id].parent_span_id.hex() == stream[2]
        assert messages[answer.id].name == "pollen.v1.Embedder/EmbedStream"
        check_timed(messages[answer.id], answer.usage.prompt_tokens)
    (span,) = http_collector.of_trace(http[1])
    assert span.parent_span_id.hex() == http[2] and span.name == "POST /v1/embeddings"
    check_timed(span, http_reply["usage"]["prompt_tokens"])
    (span,) = http_collector.of_trace(refused[1])
    assert attributes(span)["pollen.outcome"] == "INVALID_ARGUMENT" and "pollen.queue_us" not in attributes(span)
    roots = [s for _, s in spans if not s.parent_span_id]
    assert len(roots) == 1 and attributes(roots[0])["pollen.texts"] == 1  # the call that sent no context
    assert {resource["service.name"] for resource, _ in spans} == {"pollen"}
    assert {resource["pollen.frontend"] for resource, _ in spans} == {0}


def test_spans_go_to_an_otlp_grpc_collector(grpc_collector):
    srv = ServerProcess("--otlp-endpoint", grpc_collector.endpoint, env={**FAST_EXPORT, "OTEL_SERVICE_NAME": "emb"})
    srv.start()
    header, trace_id, span_id = traceparent()
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["hello"]),
                                                        metadata=[("traceparent", header)])
        ((resource, span),) = grpc_collector.wait_for(1)
    finally:
        assert srv.terminate() == 0
    assert span.trace_id.hex() == trace_id and span.parent_span_id.hex() == span_id
    check_timed(span, reply.usage.prompt_tokens)
    assert resource["service.name"] == "emb"


FRONTEND_IMPORTS = ("pollen.server.process.frontend", "pollen.server.grpc_api.service", "pollen.server.http_api.door",
                    "pollen.server.observe.tracing", "pollen.server.config")


def run_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_without_the_flag_nothing_of_opentelemetry_is_imported(tmp_path):
    code = (f"import sys\nfor m in {FRONTEND_IMPORTS!r}: __import__(m)\n"
            "from pollen.server.observe import tracing\nfrom pollen.server.config import ServeConfig\n"
            "cfg = ServeConfig(http_listen='')\n"
            "assert cfg.otlp_endpoint == '' and tracing.start(cfg.otlp_endpoint, 0) is None\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
            "tracing.start('http://127.0.0.1:9/', 0)\n"  # the check above can fail: with one, it is imported
            "print('opentelemetry.sdk.trace' in sys.modules)")
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "True"]


@pytest.mark.parametrize("endpoint", ["collector:4318", "ftp://collector", "http://"])
def test_a_bad_endpoint_is_refused_at_start(endpoint):
    result = subprocess.run([sys.executable, "-m", "pollen.server.cli", "serve",
                             "--otlp-endpoint", endpoint, "--listen", f"127.0.0.1:{free_port()}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--otlp-endpoint must be" in result.stderr, result.stderr


def test_malformed_trace_headers_are_neither_quoted_nor_logged_per_request(http_collector, tmp_path):
    """A client's bad tracestate or baggage is the client's business: the request is answered (in
    a trace of its own), the log never quotes the header, and many of them cost one throttled line."""
    log = tmp_path / "server.log"
    srv = ServerProcess("--otlp-endpoint", http_collector.endpoint, env=FAST_EXPORT, log=str(log)).start()
    secret = "s3cr3t-" + secrets.token_hex(8)
    header, _, _ = traceparent()
    metadata = [("traceparent", header), ("tracestate", f"bad key={secret}" * 20),
                ("baggage", f"{secret};;;=={secret}" * 20)]
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            for _ in range(50):
                assert stub.Embed(pb.EmbedRequest(texts=["hello"]), metadata=metadata).rows == 1
        http_collector.wait_for(50)
    finally:
        assert srv.terminate() == 0
    text = log.read_text()
    assert secret not in text
    assert len([line for line in text.splitlines() if "WARNING" in line and "trace context" in line]) <= 2


def test_rerank_calls_are_spans_with_their_task(http_collector, tmp_path):
    from pollen.common.model_spec import default_model_path
    from tests.test_rerank_api import DOCS, QUERY, make_cross_encoder

    reranker = make_cross_encoder(tmp_path / "tiny-cross-encoder")
    srv = ServerProcess("--model", default_model_path(), "--model", reranker, "--otlp-endpoint",
                        http_collector.endpoint, env=FAST_EXPORT).start()
    unary, http = traceparent(), traceparent()
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            reply = pb_grpc.EmbedderStub(channel).Rerank(pb.RerankRequest(query=QUERY, documents=DOCS),
                                                         metadata=[("traceparent", unary[0])], timeout=30)
        request = urllib.request.Request(f"http://127.0.0.1:{srv.http_port}/v2/rerank", method="POST",
                                         data=json.dumps({"query": QUERY, "documents": DOCS}).encode(),
                                         headers={"Content-Type": "application/json", "traceparent": http[0]})
        with urllib.request.urlopen(request, timeout=30) as answer:
            http_reply = json.load(answer)
        http_collector.wait_for(2)
    finally:
        assert srv.terminate() == 0
    (span,) = http_collector.of_trace(unary[1])
    assert span.parent_span_id.hex() == unary[2] and span.name == "pollen.v1.Embedder/Rerank"
    check_timed(span, reply.usage.prompt_tokens)
    assert attributes(span)["pollen.task"] == "rerank" and attributes(span)["pollen.results"] == len(DOCS)
    (span,) = http_collector.of_trace(http[1])
    assert span.name == "POST /v2/rerank" and attributes(span)["http.route"] == "/v2/rerank"
    check_timed(span, http_reply["usage"]["prompt_tokens"])
