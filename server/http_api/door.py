"""The HTTP door: OpenAI-compatible /v1/embeddings, Cohere- and Jina-shaped /v1/rerank and
/v2/rerank (server/http_api/rerank.py), /v1/classify (server/http_api/classify.py), plus /v1/models,
/health and /metrics.

A JSON body is decoded by msgspec straight into `EmbeddingsBody` (a wrong type is refused with
the path of the field), mapped onto a pb.EmbedRequest and answered by the same
core's `embed()` as gRPC's (server/core.py), so every request option behaves the same through both doors.
This file owns the JSON forms; server/http_api/http11.py owns the protocol.

JSON forms of the encodings (`encoding`, ours; `encoding_format`, OpenAI's):
- "float": float32, float16 and bfloat16 vectors as lists of numbers (the exact values of the
  encoded ones), int8 as lists of integers in [-127, 127] with the row's `scale` beside them,
  ubinary as lists of the packed bytes (integers 0..255, least-significant bit first).
- "base64": the row's raw little-endian bytes in that encoding (for float32 exactly what OpenAI
  sends); int8 rows carry `scale` here too.

With API keys (server/auth.py), /v1/embeddings, the rerank and classify routes and /v1/models
need `Authorization: Bearer KEY`, and /metrics does too with --metrics-auth; /health never does.
A request without a valid key is answered 401 with WWW-Authenticate before its body is decoded.
"""
from __future__ import annotations

import base64
import logging
import re
import time
from typing import Annotated, Literal

import grpc
import msgspec
import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pollen.common import encodings
from pollen.common.errors import RequestError, cut, echo
from pollen.common.request import LONG_INPUT_BY_NAME, PRIORITY_BY_NAME, TRUNCATE_BY_NAME
from pollen.server.auth import REALM
from pollen.server.core import Core
from pollen.server.http_api.body import Rejected, choices, decode
from pollen.server.http_api.classify import ClassifyBody, to_classify_answer, to_classify_request
from pollen.server.http_api.http11 import Request, Response
from pollen.server.http_api.rerank import RerankBody, to_rerank_answer, to_rerank_request
from pollen.server.http_api.tei import MODELS_PREFIX, TEI_ROUTES, TeiRoutes
from pollen.server.observe.metrics import TASK_OF, count_request
from pollen.v1 import embedder_pb2 as pb

log = logging.getLogger("pollen.http")

DOOR = "http"

# The proto's uint32 fields: a value past 2**32 - 1 is refused here, naming the field.
UINT32_MAX = 2**32 - 1
Positive32 = Annotated[int, msgspec.Meta(ge=1, le=UINT32_MAX)]
NonNegative32 = Annotated[int, msgspec.Meta(ge=0, le=UINT32_MAX)]


class EmbeddingsBody(msgspec.Struct, forbid_unknown_fields=True):
    # OpenAI's fields. `input`: a string, a list of strings, one list of token ids, or a list of
    # token-id lists (ids as our Tokenize returns them, special tokens included).
    input: str | list[str | int | list[int]] | None = None
    # A served model's name picks it; any other name (OpenAI's clients must send one, and most send
    # one this server cannot know, such as text-embedding-3-small) gets the first embedding model.
    model: str | None = None
    dimensions: NonNegative32 | None = None  # 0: the full size, as gRPC's 0
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None            # accepted and ignored
    # pollen's own options, as in EmbedRequest (lower-case enum names).
    encoding: Literal[encodings.NAMES] = "float32"
    normalize: bool = True             # OpenAI's vectors are unit length; gRPC's default is False
    truncate: Literal["none", "end", "start"] | None = None  # None: the server's --default-truncate
    max_tokens: NonNegative32 = 0
    prompt_name: str = ""
    prompt: str = ""
    long_input: Literal["truncate", "chunk_mean"] = "truncate"
    chunks: list[str] | None = None    # contextual chunks of ONE document, instead of `input`
    priority: Literal["interactive", "bulk"] = "interactive"
    timeout_ms: NonNegative32 = 0
    # What each data item carries, any subset: "dense" (`embedding`), "tokens" (`token_embeddings`,
    # a vector per token; BGE-M3's ColBERT vectors), "sparse" (`sparse_embedding`: a SPLADE model's
    # only output, or BGE-M3's). None: the model's default (dense; a SPLADE model's: sparse).
    outputs: list[Literal["dense", "sparse", "tokens"]] | None = None
    sparse_top_k: Positive32 | None = None  # a sparse row's largest weights kept (None: all)
    sparse_tokens: bool = False  # `sparse_embedding.tokens`: each id's vocabulary string


_DECODER = msgspec.json.Decoder(EmbeddingsBody)
_BODY_FIELDS = frozenset(EmbeddingsBody.__struct_fields__ + RerankBody.__struct_fields__
                         + ClassifyBody.__struct_fields__)
# The choices of each Literal field (`Literal[...] | None` included), named in refusals.
_CHOICES = choices(EmbeddingsBody)
_ENCODER = msgspec.json.Encoder()
_OUTPUTS = {"dense": pb.OUTPUT_DENSE, "sparse": pb.OUTPUT_SPARSE, "tokens": pb.OUTPUT_TOKENS}

# gRPC statuses to HTTP, as Google's API guidelines map them, except UNIMPLEMENTED (an option this
# build does not offer: the client can change its request, so 400 rather than a 5xx).
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNIMPLEMENTED: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.ABORTED: 409, grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNAVAILABLE: 503,
}
_ROUTES = {"/v1/embeddings": "POST", "/embeddings": "POST", "/v1/rerank": "POST", "/v2/rerank": "POST",
           "/v1/classify": "POST", "/v1/models": "GET", "/health": "GET", "/metrics": "GET", **TEI_ROUTES}
_RERANK = ("/v1/rerank", "/v2/rerank")
# The routes whose requests count in pollen_requests_total.
_COUNTED = ("/v1/embeddings", *_RERANK, "/v1/classify")
# TEI's routes (server/http_api/tei.py), and the OpenAI route under TEI's other name for it.
_TEI = frozenset(TEI_ROUTES)
_OPENAI = ("/v1/embeddings", "/embeddings")


# The service words its refusals in the proto's names; over HTTP the same things are spelled as
# this door's JSON has them: enum values lower-case without their prefix (TRUNCATE_END: "end"),
# and a text or id list's index under `input` (texts[3], token_ids[3]: input[3]).
_PROTO_ENUM = re.compile(r"\b(?:TRUNCATE|LONG_INPUT|PRIORITY|ENCODING|OUTPUT)_([A-Z0-9_]+)\b")
_PROTO_LIST = re.compile(r"\b(?:texts|token_ids)\[")
_LEADING_FIELD = re.compile(r"^(?:the default )?([a-z_]+)\b")


# Token ids on the OpenAI route are refused unless --openai-token-ids: an OpenAI client's ids are
# tiktoken's (LangChain's OpenAIEmbeddings sends cl100k ids by default), and embedded as this model's
# ids they give wrong vectors without an error.
TOKEN_IDS_REFUSED = (
    "input holds token ids, which this server cannot know to be its model's ids: OpenAI clients tokenize with "
    "tiktoken (LangChain's OpenAIEmbeddings does by default), and those ids would give wrong vectors. Send the "
    "texts instead (LangChain: OpenAIEmbeddings(..., check_embedding_ctx_length=False)), or start the server "
    "with --openai-token-ids if your client sends this model's own ids (as Tokenize or /tokenize returns them)")


def http_wording(message: str) -> tuple[str, str | None]:
    """A service refusal as this door words it, and the body field it names first (or None)."""
    message = _PROTO_LIST.sub("input[", _PROTO_ENUM.sub(lambda m: f'"{m.group(1).lower()}"', message))
    field = _LEADING_FIELD.match(message)
    param = field.group(1) if field and field.group(1) in _BODY_FIELDS else None
    return message, param


_PROTOCOL_CODES = {400: "bad_request", 408: "request_timeout", 411: "length_required", 413: "request_too_large",
                   431: "headers_too_large", 500: "internal", 503: "unavailable",
                   505: "http_version_not_supported"}


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None) -> Response:
    """An OpenAI-style error object (`code` defaults to a name for the HTTP status)."""
    code = code or _PROTOCOL_CODES.get(status)
    kind = ("rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    return Response(status, _ENCODER.encode(body), headers=headers)


class HttpDoor:
    def __init__(self, core: Core, registry):
        self.core = core
        self.registry = registry  # what /metrics serializes (server/observe/metrics.py, exposition)
        self.keys = core.keys
        self.closed = {*_COUNTED, *_OPENAI, *_TEI, "/v1/models"} | ({"/metrics"} if core.cfg.metrics_auth else set())
        self.tei = TeiRoutes(core)
        self.created = int(time.time())
        self.serving = False  # mirrors the gRPC health status: set by server/process/frontend.py

    async def handle(self, request: Request) -> Response:
        """Route a request. HEAD is answered as GET is (server/http_api/http11.py sends no body with it)."""
        path, pinned = request.path, None
        if path.startswith(MODELS_PREFIX):  # TEI's routes of one served model (server/http_api/tei.py)
            # Behind the keys before the name is looked up: a 404 would tell which names are served.
            if self.keys and (refusal := self.refuse_unauthorized(request)) is not None:
                return refusal
            pinned, path = self.tei.pinned(path)
            if pinned is None:
                return error_response(404, f"{echo(request.path)} names no served model and TEI route: "
                                      f"{MODELS_PREFIX}<name>/<route>, the models served: "
                                      f"{', '.join(m.name for m in self.core.models.models)}", code="not_found")
        method = _ROUTES.get(path)
        if method is None:
            return error_response(404, f"no route {echo(request.path)}; routes: {', '.join(_ROUTES)}, "
                                  f"and TEI's under {MODELS_PREFIX}<name>", code="not_found")
        if path == "/" and request.method in ("GET", "HEAD"):  # TEI's health check
            return Response(200 if self.serving else 503, b"" if self.serving else
                            _ENCODER.encode({"error": "unhealthy", "error_type": "unhealthy"}))
        if self.keys and pinned is None and path in self.closed:
            refusal = self.refuse_unauthorized(request)
            if refusal is not None:
                return refusal
        if request.method != method and not (request.method == "HEAD" and method == "GET"):
            allow = "GET, HEAD" if method == "GET" else method
            response = error_response(405, f"{request.path} takes {allow}, not {cut(request.method)}",
                                      code="method_not_allowed")
            response.headers["Allow"] = allow
            return response
        if path in _TEI:
            return await self.tei.handle(request, path, pinned)
        if request.path in _OPENAI:
            return await self.embeddings(request)
        if request.path in _RERANK:
            return await self.rerank(request)
        if request.path == "/v1/classify":
            return await self.classify(request)
        if request.path == "/v1/models":
            return Response(200, _ENCODER.encode({"object": "list", "data": [
                {"id": model.name, "object": "model", "created": self.created, "owned_by": "pollen",
                 "task": model.task, "dimensions": model.dimensions, "max_tokens": model.spec.max_tokens,
                 "quantization": model.quantization}
                for model in self.core.models.models]}))
        if request.path == "/health":
            status = "SERVING" if self.serving else "NOT_SERVING"
            return Response(200 if self.serving else 503, _ENCODER.encode({"status": status}))
        return Response(200, generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)

    def refuse_unauthorized(self, request: Request) -> Response | None:
        """401 unless the Authorization header carries one of the keys (RFC 6750's WWW-Authenticate
        says why: no credentials, or an invalid token)."""
        authorization = request.headers.get("authorization")
        reason = self.keys.check(authorization)
        if reason is None:
            return None
        if request.path in _COUNTED:
            count_request(DOOR, grpc.StatusCode.UNAUTHENTICATED.name, task=TASK_OF[request.path])
        response = error_response(401, reason, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = REALM + (', error="invalid_token"' if authorization else "")
        return response

    async def embeddings(self, request: Request) -> Response:
        try:
            message, encoding_format = to_embed_request(request)
        except Rejected as exc:
            count_request(DOOR, grpc.StatusCode.INVALID_ARGUMENT.name, task="embed")
            return error_response(400, exc.message, code="invalid_request", param=exc.param)
        if message.token_ids and not self.core.cfg.openai_token_ids:
            count_request(DOOR, grpc.StatusCode.INVALID_ARGUMENT.name, task="embed")
            return error_response(400, TOKEN_IDS_REFUSED, code="token_ids_refused", param="input")
        self.first_for_unknown(message)
        try:
            answer = await self.core.embed(message, DOOR, headers=request.headers,
                                           max_inputs=self.core.cfg.max_openai_inputs)
        except RequestError as exc:
            return self.refused(exc, "embeddings")
        return Response(200, _ENCODER.encode(to_openai(answer, encoding_format, answer.model,
                                                       sparse_tokens=message.sparse_tokens)))


    async def rerank(self, request: Request) -> Response:
        return await self.translated(request, "rerank", to_rerank_request, to_rerank_answer, lambda message: (
            self.core.rerank(message, DOOR, headers=request.headers, route=request.path)))

    async def classify(self, request: Request) -> Response:
        return await self.translated(request, "classify", to_classify_request,
                                     lambda answer, _: to_classify_answer(answer), lambda message: (
                                         self.core.classify(message, DOOR, headers=request.headers)))

    async def translated(self, request: Request, task: str, decode, encode, call) -> Response:
        """A JSON route of the core's: the body decoded into its pollen.v1 request (or refused 400
        naming the field), `call` the core with it, its answer encoded (`encode(answer, request)`)
        or its refusal in HTTP's terms."""
        try:
            message = decode(request.body)
        except Rejected as exc:
            count_request(DOOR, grpc.StatusCode.INVALID_ARGUMENT.name, task=task)
            return error_response(400, exc.message, code="invalid_request", param=exc.param)
        self.first_for_unknown(message)
        try:
            answer = await call(message)
        except RequestError as exc:
            return self.refused(exc, task)
        return Response(200, _ENCODER.encode(encode(answer, message)))

    def first_for_unknown(self, message) -> None:
        """A model name no served model has gets the first model of the route's task: OpenAI's and
        Cohere's clients must send a name, and most send one of their own service's
        (text-embedding-3-small, rerank-v3.5). The answer's `model` says which model answered.
        (gRPC callers name pollen's models, and an unknown name is refused there.)"""
        if message.model not in self.core.models.by_name:
            message.model = ""

    @staticmethod
    def refused(exc: RequestError, route: str) -> Response:
        status = _HTTP_STATUS.get(exc.code, 500)
        if status >= 500 and exc.code != grpc.StatusCode.UNAVAILABLE:
            log.warning("HTTP %s failed with %s: %s", route, exc.code.name, exc.message)
        message, param = http_wording(exc.message)
        return error_response(status, message, code=exc.code.name.lower(), param=param)


def to_embed_request(request: Request) -> tuple[pb.EmbedRequest, str]:
    """The HTTP request as an EmbedRequest and its encoding_format; Rejected, naming the field,
    when it cannot be."""
    body = decode(_DECODER, request.body, _CHOICES)
    message = pb.EmbedRequest(
        dimensions=body.dimensions or 0, normalize=body.normalize, encoding=encodings.BY_NAME[body.encoding],
        max_tokens=body.max_tokens, prompt_name=body.prompt_name, prompt=body.prompt,
        long_input=LONG_INPUT_BY_NAME[body.long_input], priority=PRIORITY_BY_NAME[body.priority],
        timeout_ms=body.timeout_ms, model=body.model or "")
    if body.truncate is not None:  # left unset, the server's default applies (server/pipeline/admission.py)
        message.truncate = TRUNCATE_BY_NAME[body.truncate]
    if body.outputs is not None:
        if not body.outputs:
            raise Rejected("outputs is an empty list: name at least one of dense, sparse, tokens", "outputs")
        message.outputs.extend(_OUTPUTS[name] for name in body.outputs)
    if body.sparse_top_k is not None:
        message.sparse_top_k = body.sparse_top_k
    message.sparse_tokens = body.sparse_tokens
    if body.chunks is not None:
        if body.input is not None:
            raise Rejected("set either input or chunks, not both", "chunks")
        if not body.chunks:
            raise Rejected("chunks is empty: give the chunks of one document", "chunks")
        message.chunks.extend(body.chunks)
    elif body.input is None:
        raise Rejected("input is required: a string, a list of strings, or token ids", "input")
    else:
        add_input(message, body.input)
    return message, body.encoding_format


def add_input(message: pb.EmbedRequest, value) -> None:
    if isinstance(value, str):
        value = [value]
    if not value:
        raise Rejected("input is an empty list: give at least one text", "input")
    kinds = {type(v) for v in value}
    if kinds == {str}:
        for i, text in enumerate(value):
            if not text:
                raise Rejected(f"input[{i}] is an empty string: every text needs at least one character", "input")
        message.texts.extend(value)
    elif kinds == {int}:  # one token-id sequence
        message.token_ids.add(ids=_ids(value, "input"))
    elif kinds == {list}:
        for i, ids in enumerate(value):
            if not ids:
                raise Rejected(f"input[{i}] is an empty list of token ids", "input")
            message.token_ids.add(ids=_ids(ids, f"input[{i}]"))
    else:
        raise Rejected("input mixes strings, token ids and lists of token ids; use one kind", "input")


def _ids(ids: list[int], where: str) -> list[int]:
    bad = next((i for i in ids if not -2**31 <= i < 2**31), None)
    if bad is not None:
        raise Rejected(f"{where} holds token id {bad}, outside int32", "input")
    return ids


def json_vector(row, encoding_format: str, encoding: int):
    if encoding_format == "base64":
        return base64.b64encode(row.tobytes()).decode("ascii")
    if encoding == pb.ENCODING_BFLOAT16:
        return encodings.widen_bfloat16(row).tolist()
    return row.tolist()


def to_openai(answer: pb.EmbedResponse, encoding_format: str, model: str, sparse_tokens: bool = False) -> dict:
    rows = encodings.rows_of(answer.embeddings, answer.rows, answer.dims, answer.encoding)
    data = []
    for i, row in enumerate(rows):
        dense = {"object": "embedding", "index": i, "embedding": json_vector(row, encoding_format, answer.encoding)}
        if answer.scales:
            dense["scale"] = answer.scales[i]
        data.append(dense)

    def item(i: int) -> dict:
        """Text i's data item; a text with no dense vector gets one here (outputs without "dense")."""
        if i == len(data):
            data.append({"object": "embedding", "index": i})
        return data[i]

    if answer.token_counts:  # outputs "tokens": each text's token vectors, beside its dense one if asked
        texts = encodings.ragged(answer.token_embeddings, np.float32, answer.token_counts, answer.dims)
        for i, rows in enumerate(texts):
            item(i)["token_embeddings"] = [json_vector(row, encoding_format, pb.ENCODING_FLOAT32) for row in rows]
    if answer.sparse_counts:  # outputs "sparse": ids ascending and their weights (and their tokens)
        ids = encodings.ragged(answer.sparse_indices, np.uint32, answer.sparse_counts)
        weights = encodings.ragged(answer.sparse_values, np.float32, answer.sparse_counts)
        strings = iter(answer.sparse_tokens)
        for i, (t, w) in enumerate(zip(ids, weights)):
            sparse = item(i)["sparse_embedding"] = {"indices": t.tolist(), "values": w.tolist()}
            if sparse_tokens:
                sparse["tokens"] = [next(strings) for _ in range(len(t))]
    tokens = answer.usage.prompt_tokens
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

