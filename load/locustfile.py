"""Locust users for pollen's three ways in: gRPC streaming, gRPC unary and HTTP (OpenAI-style).

Against a running `pollen serve` (gRPC on 50051, HTTP on 8080), one command, headless:

    locust -f load/locustfile.py --headless -u 20 -r 5 -t 60s --only-summary \
        --host http://127.0.0.1:8080 --grpc-target 127.0.0.1:50051

Users come 2 : 2 : 1 (unary, HTTP, stream). Each mixes short queries (one text a request) and
documents (4 passages a request); the
texts come from load/corpus.py, made with fixed seeds. gRPC calls are reported to locust as
request events (type "grpc") named after the call, so the stats table shows each beside HTTP's.
An answer only counts as a success when it holds one vector of the model's size per text.
Against a server with API keys, give one with --api-key (or POLLEN_API_KEY): every user sends it,
gRPC users as the `authorization` metadata, HTTP users as the Authorization header.

GrpcRerankUser (1 query x --rerank-documents documents a Rerank call, default 20) runs only when
named, against a server that serves a reranker:

    locust -f load/locustfile.py GrpcRerankUser --headless -u 8 -r 4 -t 60s --only-summary \
        --host http://127.0.0.1:8080 --grpc-target 127.0.0.1:50051
"""
from __future__ import annotations

import os
import random
import sys
import time

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpc's I/O must yield to gevent, or one user's call blocks every user

import grpc  # noqa: E402
from locust import FastHttpUser, User, between, events, task  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # corpus.py beside this file
from corpus import documents, queries  # noqa: E402

from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402

QUERIES, DOCUMENTS = queries(), documents()
DOCS_PER_REQUEST = 4
MESSAGES_PER_STREAM = 8
TIMEOUT_S = 120


@events.init_command_line_parser.add_listener
def _add_grpc_target(parser) -> None:
    parser.add_argument("--grpc-target", default="127.0.0.1:50051", help="pollen's gRPC address")
    first_key = next((k.strip() for k in os.environ.get("POLLEN_API_KEY", "").split(",") if k.strip()), "")
    parser.add_argument("--api-key", default=first_key, help="the server's API key [env POLLEN_API_KEY]")
    parser.add_argument("--rerank-documents", type=int, default=20, help="documents of each GrpcRerankUser call")


@events.init.add_listener
def _rerank_only_when_named(environment, **_kwargs) -> None:
    """A run that names no user class runs the embedding users only: a reranker is a server of
    its own (or one model of several), named with GrpcRerankUser."""
    if GrpcRerankUser.__name__ not in (environment.parsed_options.user_classes or []):
        environment.user_classes[:] = [u for u in environment.user_classes if u is not GrpcRerankUser]


def bearer(environment) -> dict[str, str]:
    """The Authorization header for the --api-key given (none without one)."""
    key = environment.parsed_options.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


class WrongAnswer(Exception):
    pass


def check(answer: pb.EmbedResponse, texts: int) -> None:
    if answer.HasField("error"):
        raise WrongAnswer(f"error {answer.error.code}: {answer.error.message}")
    if answer.rows != texts or len(answer.embeddings) != 4 * texts * answer.dims:
        raise WrongAnswer(f"{answer.rows} rows of {answer.dims} for {texts} texts")


def pick(rng: random.Random, kind: str) -> list[str]:
    return [rng.choice(QUERIES)] if kind == "query" else rng.sample(DOCUMENTS, DOCS_PER_REQUEST)


_STUBS: dict[str, pb_grpc.EmbedderStub] = {}


def shared_stub(target: str) -> pb_grpc.EmbedderStub:
    """One channel for every gRPC user of this locust process, as one client process would hold
    (its calls multiplexed on one HTTP/2 connection)."""
    if target not in _STUBS:
        _STUBS[target] = pb_grpc.EmbedderStub(grpc.insecure_channel(target))
    return _STUBS[target]


class GrpcUser(User):
    abstract = True
    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.rng = random.Random(id(self))
        self.stub = shared_stub(self.environment.parsed_options.grpc_target)
        self.metadata = tuple((k.lower(), v) for k, v in bearer(self.environment).items()) or None

    def report(self, name: str, started: float, length: int, exception: Exception | None) -> None:
        self.environment.events.request.fire(
            request_type="grpc", name=name, response_time=(time.perf_counter() - started) * 1000,
            response_length=length, exception=exception, context={})


class GrpcUnaryUser(GrpcUser):
    """One Embed call at a time."""

    weight = 2

    def embed(self, kind: str) -> None:
        texts = pick(self.rng, kind)
        started, length, failure = time.perf_counter(), 0, None
        try:
            answer = self.stub.Embed(pb.EmbedRequest(texts=texts, normalize=True), timeout=TIMEOUT_S,
                                     metadata=self.metadata)
            check(answer, len(texts))
            length = len(answer.embeddings)
        except (grpc.RpcError, WrongAnswer) as exc:
            failure = exc
        self.report(f"Embed {kind}", started, length, failure)

    @task(3)
    def query(self) -> None:
        self.embed("query")

    @task(1)
    def docs(self) -> None:
        self.embed("docs")


class GrpcStreamUser(GrpcUser):
    """One EmbedStream of 8 messages (documents and queries alternating), all sent at once;
    each message is reported when its answer arrives. The bulk of the load: 20 users hold 4 of these."""

    weight = 1

    @task
    def stream(self) -> None:
        sent: dict[str, tuple[float, str, int]] = {}

        def messages():
            for i in range(MESSAGES_PER_STREAM):
                kind = "query" if i % 2 else "docs"
                texts = pick(self.rng, kind)
                sent[str(i)] = (time.perf_counter(), kind, len(texts))
                yield pb.EmbedRequest(id=str(i), texts=texts, normalize=True)

        started = time.perf_counter()
        try:
            for answer in self.stub.EmbedStream(messages(), timeout=TIMEOUT_S, metadata=self.metadata):
                t0, kind, texts = sent.pop(answer.id)
                try:
                    check(answer, texts)
                    self.report(f"EmbedStream {kind} message", t0, len(answer.embeddings), None)
                except WrongAnswer as exc:
                    self.report(f"EmbedStream {kind} message", t0, 0, exc)
            failure = WrongAnswer(f"{len(sent)} messages unanswered") if sent else None
        except grpc.RpcError as exc:
            failure = exc
        self.report("EmbedStream (whole stream)", started, 0, failure)


class HttpEmbeddingsUser(FastHttpUser):
    """POST /v1/embeddings as an OpenAI client would (float JSON)."""

    weight = 2

    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.rng = random.Random(id(self))
        self.headers = bearer(self.environment)

    def embed(self, kind: str) -> None:
        texts = pick(self.rng, kind)
        body = {"model": "pollen", "input": texts, "encoding_format": "float"}
        with self.client.post("/v1/embeddings", json=body, name=f"/v1/embeddings {kind}", headers=self.headers,
                              catch_response=True, timeout=TIMEOUT_S) as reply:
            if reply.status_code != 200:
                reply.failure(f"HTTP {reply.status_code}: {reply.text[:200]}")
                return
            data = reply.json()["data"]
            if len(data) != len(texts) or any(len(d["embedding"]) != len(data[0]["embedding"]) for d in data):
                reply.failure(f"{len(data)} vectors for {len(texts)} texts")

    @task(3)
    def query(self) -> None:
        self.embed("query")

    @task(1)
    def docs(self) -> None:
        self.embed("docs")


class GrpcRerankUser(GrpcUser):
    """One Rerank call at a time: a query and --rerank-documents passages. An answer counts as a
    success when it scores every document once, best first."""

    weight = 1

    @task
    def rerank(self) -> None:
        count = self.environment.parsed_options.rerank_documents
        request = pb.RerankRequest(query=self.rng.choice(QUERIES), documents=self.rng.sample(DOCUMENTS, count))
        started, length, failure = time.perf_counter(), 0, None
        try:
            answer = self.stub.Rerank(request, timeout=TIMEOUT_S, metadata=self.metadata)
            scores = [r.score for r in answer.results]
            if sorted(r.index for r in answer.results) != list(range(count)) or scores != sorted(scores, reverse=True):
                raise WrongAnswer(f"{len(answer.results)} results, not each of {count} documents best first")
            length = answer.ByteSize()
        except (grpc.RpcError, WrongAnswer) as exc:
            failure = exc
        self.report(f"Rerank 1 x {count}", started, length, failure)
