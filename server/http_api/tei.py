"""Hugging Face text-embeddings-inference's HTTP API on the HTTP door, in TEI's request and
response shapes (its router's `http/types.rs` and OpenAPI document), answered by the same
core methods (server/core.py) as pollen's own routes:

    GET  /info          the served model as TEI describes it (model_type, max_input_length, ...)
    POST /embed         {inputs, normalize, truncate, truncation_direction, prompt_name, dimensions} -> [[f32]]
    POST /similarity    {inputs: {source_sentence, sentences}, parameters} -> [f32] (cosine)
    POST /rerank        {query, texts, raw_scores, return_text, truncate, truncation_direction}
                        -> [{index, score, text?}], best first
    POST /predict       {inputs: str | [a, b] | [[a], [a, b], ...], raw_scores, truncate} -> [{score, label}]
                        (a batch: one such list per input), labels best first
    POST /tokenize      {inputs, add_special_tokens, prompt_name} -> [[{id, text, special, start, stop}]]
                        (start and stop: UTF-8 byte offsets into the (prompted) input; null for special tokens)
    POST /decode        {ids, skip_special_tokens} -> [str]
    POST /embed_all     {inputs, truncate, truncation_direction, prompt_name} -> [[[f32]]]: every token's
                        last hidden state, special tokens included, not normalized (outputs OUTPUT_TOKENS;
                        BGE-M3's are its ColBERT vectors)
    POST /embed_sparse  {inputs, truncate, truncation_direction, prompt_name} -> [[{index, value}]]: the first
                        sparse model's (SPLADE or BGE-M3) non-zero weights, by ascending index (424 when
                        none is served)
    POST /              TEI's default route, which in TEI follows its one model's task: /embed for an
                        embedder (/similarity when `inputs` is an object, which is what huggingface_hub's
                        InferenceClient.sentence_similarity sends; BGE-M3 is one), /embed_sparse for a
                        SPLADE model, /rerank for a reranker, /predict for a classifier. Here the body's
                        shape picks the task where it can (see `default_route`).

TEI's requests name no model: each route serves the first served model of the task it needs
(/info, /tokenize and /decode: the first model). Every route is also served under
/models/<served name>/ (the name as --served-model-name gives it, percent-encoded or not), for
that model alone: /models/<name>/info describes it, /models/<name> (POST) is its default route,
and a route of a task it does not serve answers 424. TEI's clients read /info before they call
and take a base URL, so `tei_client.HttpClient("http://host:8080/models/<name>")` and
`huggingface_hub.InferenceClient(base_url="http://host:8080/models/<name>")` reach one model
of a server of several, unchanged. TEI's `truncate` is a bool (null: the server's
--default-truncate); `truncation_direction` "right" cuts a text's end, "left" its start.

Errors are TEI's body {"error": ..., "error_type": ...} with TEI's status for the type: a body
that does not decode 422 (validation), an empty batch 400 (empty), a refused request 413
(validation: too many inputs, an input over the model's limit without truncate, a bad option),
a task the served models do not serve 424 (backend), a full server 429 (overloaded), a stopping
one 503 (unhealthy).
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import re
import uuid
from typing import Any, Literal
from urllib.parse import unquote

import grpc
import msgspec
import numpy as np

from pollen.common import encodings
from pollen.common.errors import RequestError
from pollen.server.core import Core
from pollen.server.http_api.body import Rejected, choices, decode
from pollen.server.http_api.http11 import Request, Response
from pollen.server.model_table import KINDS, ServedModel
from pollen.server.tei import tei_tokens
from pollen.v1 import embedder_pb2 as pb

DOOR = "http"
# TEI's routes and their methods ("/" is GET for health and POST for the default route).
TEI_ROUTES = {"/info": "GET", "/embed": "POST", "/embed_all": "POST", "/embed_sparse": "POST", "/rerank": "POST",
              "/predict": "POST", "/similarity": "POST", "/tokenize": "POST", "/decode": "POST", "/": "POST"}
# TEI's routes of one served model: MODELS_PREFIX + its name + a TEI route ("" or "/" for "/").
MODELS_PREFIX = "/models/"
# Each kind's default route (ServedModel.kinds[0]), as TEI's POST / serves a model of that kind.
_DEFAULT_ROUTE = {"embed": "/embed", "sparse": "/embed_sparse", "rerank": "/rerank", "classify": "/predict"}
_NOT_SERVED = {"embed": "model is not an embedding model", "rerank": "model is not a re-ranker model",
               "classify": "model is not a classifier model",
               "sparse": "model is not an embedding model with SPLADE pooling"}
_STATUS = {"validation": 413, "empty": 400, "backend": 424, "overloaded": 429, "unhealthy": 503, "tokenizer": 422}
_ENCODER = msgspec.json.Encoder()
Direction = Literal["right", "left", "Right", "Left"]


class TeiError(Exception):
    def __init__(self, message: str, error_type: str, status: int | None = None):
        super().__init__(message)
        self.message, self.error_type = message, error_type
        self.status = status or _STATUS[error_type]


def tei_error_response(exc: TeiError) -> Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else {}
    return Response(exc.status, _ENCODER.encode({"error": exc.message, "error_type": exc.error_type}),
                    headers=headers)


class EmbedBody(msgspec.Struct):
    inputs: Any
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None
    dimensions: int | None = None
    encoding_format: Literal["float"] = "float"  # huggingface_hub sends it; TEI's vectors are floats


class EmbedAllBody(msgspec.Struct):
    inputs: Any
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class SimilarityParameters(msgspec.Struct):
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class SimilarityInput(msgspec.Struct):
    source_sentence: str
    sentences: list[str]


class SimilarityBody(msgspec.Struct):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


class RerankBody(msgspec.Struct):
    query: str
    texts: list[str]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: bool = False
    return_text: bool = False


class PredictBody(msgspec.Struct):
    inputs: str | list[str | list[str]]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: bool = False


class TokenizeBody(msgspec.Struct):
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeBody(msgspec.Struct):
    ids: list[int | list[int]]
    skip_special_tokens: bool = True


class Shape(msgspec.Struct):
    """POST /'s body as far as its route depends on it: which fields are there, and whether
    `inputs` is an object (the values are not parsed)."""
    inputs: msgspec.Raw = msgspec.Raw()
    query: msgspec.Raw = msgspec.Raw()
    parameters: msgspec.Raw = msgspec.Raw()


_DECODERS = {body: msgspec.json.Decoder(body) for body in
             (EmbedBody, EmbedAllBody, SimilarityBody, RerankBody, PredictBody, TokenizeBody, DecodeBody)}
_CHOICES = {body: choices(body) for body in _DECODERS}
_SHAPE = msgspec.json.Decoder(Shape)


def body_of(kind: type, data: bytes):
    try:
        return decode(_DECODERS[kind], data, _CHOICES[kind])
    except Rejected as exc:  # axum's Json extractor answers a body it cannot take 422
        raise TeiError(exc.message, "validation", 422) from None


def set_truncate(message, truncate: bool | None, direction: str) -> None:
    """TEI's truncate (null: the server's default) as pollen's Truncate."""
    if truncate is not None:
        message.truncate = (pb.TRUNCATE_NONE if not truncate else
                            pb.TRUNCATE_START if direction.lower() == "left" else pb.TRUNCATE_END)


def add_inputs(message: pb.EmbedRequest, inputs) -> None:
    """TEI's Input: a string, one list of token ids, or a list of strings and id lists (one kind)."""
    if isinstance(inputs, str):
        inputs = [inputs]
    elif isinstance(inputs, list) and inputs and all(isinstance(i, int) and not isinstance(i, bool) for i in inputs):
        inputs = [inputs]
    if not isinstance(inputs, list):
        raise TeiError("inputs must be a string, a list of strings or a list of token-id lists", "validation", 422)
    if not inputs:
        raise TeiError("`inputs` cannot be empty", "empty")
    if all(isinstance(i, str) for i in inputs):
        message.texts.extend(inputs)
    elif all(isinstance(i, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in i) for i in inputs):
        for i, ids in enumerate(inputs):
            if not ids:
                raise TeiError(f"inputs[{i}] is an empty list of token ids", "empty")
            bad = next((t for t in ids if not 0 <= t < 2**31), None)
            if bad is not None:
                raise TeiError(f"inputs[{i}] holds token id {bad}, outside [0, 2**31)", "validation", 422)
            message.token_ids.add(ids=ids)
    else:
        raise TeiError("inputs mixes strings and token-id lists, or holds something else; use one kind",
                       "validation", 422)


_PROTO_TRUNCATE = re.compile(r"set truncate to TRUNCATE_\w+(?: or TRUNCATE_\w+)?")
_LONG_INPUT = re.compile(r",? or set long_input to LONG_INPUT_\w+")
_PROTO_LIST = re.compile(r"\b(?:texts|token_ids|documents)\[")


def tei_wording(message: str) -> str:
    """A service refusal in the words of TEI's fields (truncate is a bool there)."""
    message = _PROTO_TRUNCATE.sub("set truncate to true", _LONG_INPUT.sub("", message))
    return _PROTO_LIST.sub("inputs[", message)


def from_request_error(exc: RequestError) -> TeiError:
    code = exc.code
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return TeiError(exc.message, "overloaded")
    if code == grpc.StatusCode.UNAVAILABLE:
        return TeiError(exc.message, "unhealthy")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
        return TeiError(f"Input validation error: {tei_wording(exc.message)}", "validation")
    return TeiError(exc.message, "backend")


def version() -> str:
    try:
        return importlib.metadata.version("pollen")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def tokens_of(text: str, encoding) -> list[dict]:
    """One encoding as TEI's SimpleTokens (server/tei.py), as JSON objects."""
    return [token._asdict() for token in tei_tokens(text, encoding)]


class TeiRoutes:
    """TEI's routes over the core (the HTTP door routes them here). Every route takes
    `pinned`: the model a /models/<name>/ path names, or None for the first model of the route's
    task."""

    def __init__(self, core: Core):
        self.core = core
        # Longest name first, so that of names "a" and "a/b" the path /models/a/b/info finds "a/b".
        self.by_length = sorted(core.models.models, key=lambda m: -len(m.name))

    def pinned(self, path: str) -> tuple[ServedModel | None, str]:
        """(the served model, the TEI route) that a MODELS_PREFIX path names; (None, path) when
        it names no served model followed by a TEI route."""
        rest = unquote(path[len(MODELS_PREFIX):])
        for model in self.by_length:
            if rest.startswith(model.name) and (route := rest[len(model.name):] or "/") in TEI_ROUTES:
                return model, route
        return None, path

    async def handle(self, request: Request, route: str, pinned: ServedModel | None = None) -> Response:
        try:
            if route == "/":
                route = self.default_route(request.body, pinned)
            answer = await getattr(self, route.strip("/") or "info")(request, pinned)
            return Response(200, _ENCODER.encode(answer))
        except TeiError as exc:
            return tei_error_response(exc)
        except RequestError as exc:
            return tei_error_response(from_request_error(exc))

    def default_route(self, body: bytes, pinned: ServedModel | None) -> str:
        """POST /'s route. Under /models/<name>/: that model's own, as TEI's. Otherwise the body's
        shape picks where it can, since a server of several models has no one task: `query`
        reranks; an object `inputs` is a similarity; `parameters` beside `inputs` (the Inference
        API's shape, which huggingface_hub's text_classification sends and its feature_extraction
        never does) predicts when a classifier is served; anything else goes to the first model
        that takes `inputs` (an embedder or a classifier), else to the reranker (which answers
        422 for the missing `query`, as TEI's does)."""
        try:
            shape = _SHAPE.decode(body)
        except msgspec.DecodeError:  # the route's own decoder says what is wrong with it
            shape = Shape()
        similarity = bytes(shape.inputs)[:1] == b"{"
        kinds = [m.kinds[0] for m in self.core.models.models]
        if pinned is not None:
            kind = pinned.kinds[0]
        elif shape.query:
            kind = "rerank"
        elif similarity:
            kind = "embed"
        elif shape.parameters and "classify" in kinds:
            kind = "classify"
        else:
            kind = next((k for k in kinds if k != "rerank"), "rerank")
        return "/similarity" if kind == "embed" and similarity else _DEFAULT_ROUTE[kind]

    def model(self, kind: str, pinned: ServedModel | None) -> ServedModel:
        """`pinned`, checked to be of `kind`, else the first model of `kind` (ServedModel.kinds:
        "embed" a dense embedder, "sparse" a SPLADE one; BGE-M3 is both)."""
        if pinned is not None:
            if kind not in pinned.kinds:
                raise TeiError(f"{_NOT_SERVED[kind]}: {pinned.name} is {KINDS[pinned.task]}", "backend")
            return pinned
        model = next((m for m in self.core.models.models if kind in m.kinds), None)
        if model is None:
            raise TeiError(f"{_NOT_SERVED[kind]}: the models served here are {self.core.models.served()}",
                           "backend")
        return model

    async def info(self, request: Request, pinned: ServedModel | None) -> dict:
        cfg, model = self.core.cfg, pinned or self.core.models.first
        spec = model.spec
        if spec.task == "embed":
            model_type = {"embedding": {"pooling": "splade" if spec.sparse_terms else spec.pooling}}
        else:
            labels = {"id2label": {str(i): name for i, name in enumerate(spec.labels)},
                      "label2id": {name: i for i, name in enumerate(spec.labels)}}
            model_type = {"reranker" if spec.task == "rerank" else "classifier": labels}
        return {
            "model_id": spec.name, "served_model_name": spec.name, "model_sha": cfg.revision,
            "model_dtype": cfg.worker_dtype(), "model_type": model_type,
            "prompts": dict(spec.prompts) or None,
            "default_prompt": dict(spec.prompts).get(spec.default_prompt_name) if spec.default_prompt_name else None,
            "max_concurrent_requests": cfg.http_max_connections, "max_input_length": spec.max_tokens,
            "max_batch_tokens": cfg.max_batch_tokens, "max_batch_requests": None,
            "max_client_batch_size": cfg.max_texts_per_request, "auto_truncate": cfg.default_truncate != "none",
            "tokenization_workers": cfg.tokenizer_threads, "version": version(), "sha": None, "docker_label": None}

    async def embed_request(self, model: ServedModel, message: pb.EmbedRequest, headers) -> np.ndarray:
        message.model = model.name
        message.id = f"tei-{uuid.uuid4().hex}"
        answer = await self.core.embed(message, DOOR, headers=headers)
        return encodings.rows_of(answer.embeddings, answer.rows, answer.dims, answer.encoding)

    async def embed(self, request: Request, pinned: ServedModel | None) -> list:
        body = body_of(EmbedBody, request.body)
        model = self.model("embed", pinned)
        if body.dimensions is not None and not 0 <= body.dimensions < 2**32:
            raise TeiError(f"dimensions must be a count of 0 or more, got {body.dimensions}", "validation", 422)
        message = pb.EmbedRequest(normalize=body.normalize, prompt_name=body.prompt_name or "",
                                  dimensions=body.dimensions or 0)
        add_inputs(message, body.inputs)
        set_truncate(message, body.truncate, body.truncation_direction)
        return (await self.embed_request(model, message, request.headers)).tolist()

    async def similarity(self, request: Request, pinned: ServedModel | None) -> list:
        body = body_of(SimilarityBody, request.body)
        model = self.model("embed", pinned)
        if not body.inputs.sentences:
            raise TeiError("`inputs.sentences` cannot be empty", "empty")
        parameters = body.parameters or SimilarityParameters()
        message = pb.EmbedRequest(texts=[body.inputs.source_sentence, *body.inputs.sentences], normalize=True,
                                  prompt_name=parameters.prompt_name or "")
        set_truncate(message, parameters.truncate, parameters.truncation_direction)
        rows = (await self.embed_request(model, message, request.headers)).astype(np.float64)
        return (rows[1:] @ rows[0]).tolist()

    async def embed_all(self, request: Request, pinned: ServedModel | None) -> list:
        """Every token's last hidden state, special tokens included, not normalized: a list of
        token vectors per input (BGE-M3: its ColBERT vectors, normalized as the model defines them)."""
        body = body_of(EmbedAllBody, request.body)
        model = self.model("embed", pinned)
        message = pb.EmbedRequest(normalize=False, prompt_name=body.prompt_name or "", outputs=[pb.OUTPUT_TOKENS],
                                  model=model.name, id=f"tei-{uuid.uuid4().hex}")
        add_inputs(message, body.inputs)
        set_truncate(message, body.truncate, body.truncation_direction)
        answer = await self.core.embed(message, DOOR, headers=request.headers)
        return [rows.tolist() for rows in encodings.ragged(answer.token_embeddings, np.float32, answer.token_counts,
                                                           answer.dims)]

    async def embed_sparse(self, request: Request, pinned: ServedModel | None) -> list:
        """The first sparse model's non-zero weights of each input, as [{index, value}] by ascending index."""
        body = body_of(EmbedAllBody, request.body)
        model = self.model("sparse", pinned)
        message = pb.EmbedRequest(prompt_name=body.prompt_name or "", outputs=[pb.OUTPUT_SPARSE], model=model.name,
                                  id=f"tei-{uuid.uuid4().hex}")
        add_inputs(message, body.inputs)
        set_truncate(message, body.truncate, body.truncation_direction)
        answer = await self.core.embed(message, DOOR, headers=request.headers)
        ids = encodings.ragged(answer.sparse_indices, np.uint32, answer.sparse_counts)
        weights = encodings.ragged(answer.sparse_values, np.float32, answer.sparse_counts)
        return [[{"index": int(i), "value": float(w)} for i, w in zip(row_ids, row_weights)]
                for row_ids, row_weights in zip(ids, weights)]

    async def rerank(self, request: Request, pinned: ServedModel | None) -> list:
        body = body_of(RerankBody, request.body)
        model = self.model("rerank", pinned)
        if not body.texts:
            raise TeiError("`texts` cannot be empty", "empty")
        message = pb.RerankRequest(query=body.query, documents=body.texts, model=model.name,
                                   raw_scores=body.raw_scores, return_documents=body.return_text,
                                   id=f"tei-{uuid.uuid4().hex}")
        set_truncate(message, body.truncate, body.truncation_direction)
        answer = await self.core.rerank(message, DOOR, headers=request.headers, route=request.path)
        out = []
        for r in answer.results:
            rank = {"index": r.index, "score": r.score}
            if body.return_text:
                rank["text"] = r.document
            out.append(rank)
        return out

    async def predict(self, request: Request, pinned: ServedModel | None) -> list:
        body = body_of(PredictBody, request.body)
        model = self.model("classify", pinned)
        single, sequences = predict_inputs(body.inputs)
        # pollen's Classify takes texts or pairs: a batch of both goes as two requests.
        groups = {}
        for i, seq in enumerate(sequences):
            groups.setdefault(len(seq), []).append(i)

        async def classified(indices: list[int]) -> list:
            message = pb.ClassifyRequest(texts=[sequences[i][0] for i in indices], model=model.name,
                                         raw_scores=body.raw_scores, id=f"tei-{uuid.uuid4().hex}")
            if len(sequences[indices[0]]) == 2:
                message.text_pairs.extend(sequences[i][1] for i in indices)
            set_truncate(message, body.truncate, body.truncation_direction)
            answer = await self.core.classify(message, DOOR, headers=request.headers)
            return [[{"score": s.score, "label": s.label} for s in r.labels] for r in answer.results]

        order = list(groups.values())
        answers = await asyncio.gather(*(classified(indices) for indices in order))
        out: list = [None] * len(sequences)
        for indices, results in zip(order, answers):
            for i, result in zip(indices, results):
                out[i] = result
        return out[0] if single else out

    async def tokenize(self, request: Request, pinned: ServedModel | None) -> list:
        body = body_of(TokenizeBody, request.body)
        model = pinned or self.core.models.first
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        if not texts:
            raise TeiError("`inputs` cannot be empty", "empty")
        admission = model.admission
        admission.check_count(len(texts))
        prompt = admission.prompt(body.prompt_name or "", "", model.spec.max_tokens) if body.prompt_name else ""
        texts = [prompt + text for text in texts]
        tokenizer = admission.tokenizer.tokenizer

        def tokenized() -> list:
            encoded = tokenizer.encode_batch(texts, add_special_tokens=body.add_special_tokens)
            return [tokens_of(text, encoding) for text, encoding in zip(texts, encoded)]
        return await admission.run(sum(map(len, texts)), tokenized)

    async def decode(self, request: Request, pinned: ServedModel | None) -> list:
        body = body_of(DecodeBody, request.body)
        model = pinned or self.core.models.first
        kinds = {type(i) for i in body.ids}
        if len(kinds) > 1:
            raise TeiError("ids mixes token ids and lists of them; give one list, or a list of lists", "validation",
                           422)
        batch = body.ids if kinds == {list} else [body.ids]
        if not batch or not all(batch):
            raise TeiError("`ids` cannot be empty", "empty")
        model.admission.check_count(len(batch))
        tokenizer = model.admission.tokenizer.tokenizer
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        for i, ids in enumerate(batch):
            bad = next((t for t in ids if not 0 <= t < size), None)
            if bad is not None:
                raise TeiError(f"ids[{i}] holds token id {bad}, outside the vocabulary [0, {size})", "tokenizer")
        return tokenizer.decode_batch(batch, skip_special_tokens=body.skip_special_tokens)


def predict_inputs(inputs) -> tuple[bool, list[list[str]]]:
    """TEI's PredictInput: (is it one input, the sequences as [text] or [text, pair])."""
    if isinstance(inputs, str):
        return True, [[inputs]]
    if not inputs:
        raise TeiError("`inputs` cannot be empty", "empty")
    if all(isinstance(i, str) for i in inputs):
        if len(inputs) > 2:
            raise TeiError("inputs holds more than two strings: give one text, a pair [text, text], or a batch "
                           "[[text], [text, text], ...]", "validation", 422)
        return True, [list(inputs)]
    if not all(isinstance(i, list) for i in inputs):
        raise TeiError("inputs mixes strings and lists: a batch is [[text], [text, text], ...]", "validation", 422)
    for i, seq in enumerate(inputs):
        if len(seq) not in (1, 2):
            raise TeiError(f"inputs[{i}] has {len(seq)} strings: each input is [text] or [text, text]",
                           "validation", 422)
    return False, inputs
