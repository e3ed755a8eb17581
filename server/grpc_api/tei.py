"""TEI's gRPC API (`tei.v1`, protos/pollen/tei/v1/tei.proto) on pollen's gRPC port, beside pollen.v1.

Each TEI method is a pollen.v1 request through EmbedderService (server/grpc_api/service.py): Embed is an
`embed` of one text, EmbedAll an `embed` of its token vectors (outputs OUTPUT_TOKENS, not
normalized), Rerank a `rerank`, Predict and PredictPair a `classify` of one text or pair,
Tokenize and Decode the model's tokenizer; admission, batching, metrics and tracing are the
service's. TEI's requests name no model: each method serves the first model of the task it needs
(Info, Tokenize and Decode: the first model), and a server that has none answers
FAILED_PRECONDITION naming what is missing, as TEI answers a task its model does not serve; Embed
and EmbedAll take the first dense embedder, EmbedSparse the first sparse one (SPLADE, or BGE-M3,
which is both; for it EmbedAll answers its ColBERT vectors, as pollen.v1's token vectors do). A
call whose metadata carries `pollen-model: <served name>` (MODEL_KEY) is that model's alone, as
HTTP's /models/<name>/ routes are: Info describes it, and a method of a task it does not serve
answers FAILED_PRECONDITION. (tei-client's GrpcClient sends no metadata of its own; its
HttpClient reaches one model through /models/<name>.)

The streams answer as TEI's do: one answer per message, in the order the messages came, the
first failure ending the stream with its status (the messages before it answered). A stream
holds at most --max-stream-in-flight messages whose answers gRPC has not taken (as pollen's
streams). RerankStream takes one (query, text) pair a message and answers once, when the client
ends its side: the pairs ranked, `index` the message's position, raw_scores and return_text as
its first message sets them.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import time

import grpc
import numpy as np

from pollen.common.errors import RequestError, invalid
from pollen.server.core import Core
from pollen.server.grpc_api import service as svc
from pollen.server.grpc_api.service import EmbedderService, Oversize, Undecodable
from pollen.server.model_table import KINDS, ServedModel
from pollen.server.tei import tei_tokens
from pollen.tei.v1 import tei_pb2 as tei
from pollen.v1 import embedder_pb2 as pb

SERVICES = tuple(tei.DESCRIPTOR.services_by_name.values())
SERVICE_NAMES = tuple(s.full_name for s in SERVICES)
MODEL_TYPE = {"embed": tei.MODEL_TYPE_EMBEDDING, "classify": tei.MODEL_TYPE_CLASSIFIER,
              "rerank": tei.MODEL_TYPE_RERANKER}
# The TEI services that answer when the server holds a model of the task (None: any model).
SERVICE_TASK = {"tei.v1.Info": None, "tei.v1.Tokenize": None, "tei.v1.Embed": "embed", "tei.v1.Rerank": "rerank",
                "tei.v1.Predict": "classify"}
NEEDS = {"embed": "an embedding model", "sparse": "a sparse (SPLADE) embedding model or BGE-M3",
         "rerank": "a re-ranker model", "classify": "a classifier model"}
# The call metadata that names the one served model a tei.v1 call is for (TEI's messages have no model).
MODEL_KEY = "pollen-model"
try:
    VERSION = importlib.metadata.version("pollen")
except importlib.metadata.PackageNotFoundError:  # a checkout that is not installed
    VERSION = "0.0.0"


def add_to_server(service: EmbedderService, server) -> TeiService:
    """Register every tei.v1 service's methods, behind the API keys as pollen.v1's are."""
    methods = TeiService(service.core)
    for descriptor in SERVICES:
        svc.add_service(service, server, descriptor, methods)
    return methods


def serving_names(tasks: set[str]) -> tuple[str, ...]:
    """The TEI services the health service calls SERVING while the server serves, for a server
    whose models serve `tasks` (the others are always NOT_SERVING, as in TEI)."""
    return tuple(name for name, task in SERVICE_TASK.items() if task is None or task in tasks)


def truncate_of(request) -> int:
    """TEI's truncate and truncation_direction as pollen's Truncate."""
    if not request.truncate:
        return pb.TRUNCATE_NONE
    if request.truncation_direction == tei.TRUNCATION_DIRECTION_LEFT:
        return pb.TRUNCATE_START
    if request.truncation_direction == tei.TRUNCATION_DIRECTION_RIGHT:
        return pb.TRUNCATE_END
    raise invalid(f"truncation_direction {request.truncation_direction} is not a known TruncationDirection value")


def renamed(exc: RequestError, fields: dict[str, str]) -> RequestError:
    """pollen's refusal with its field names as the TEI request names them."""
    message = exc.message
    for ours, theirs in fields.items():
        message = message.replace(ours, theirs)
    return RequestError(exc.code, message)


def metadata(chars: int, tokens: int, started_ns: int, timing: pb.Timing) -> tei.Metadata:
    return tei.Metadata(compute_chars=chars, compute_tokens=tokens, total_time_ns=time.monotonic_ns() - started_ns,
                        tokenization_time_ns=timing.tokenize_us * 1000, queue_time_ns=timing.queue_us * 1000,
                        inference_time_ns=timing.inference_us * 1000)


class TeiService:
    """The tei.v1 methods, each one or more calls of the core (server/core.py)."""

    def __init__(self, core: Core):
        self.core = core
        self.models = core.models

    def named(self, headers) -> ServedModel | None:
        """The model the call's MODEL_KEY metadata names (None: it names none); a name no model
        has is INVALID_ARGUMENT naming the models served."""
        name = next((value for key, value in (headers() if headers else ()) if key == MODEL_KEY), "")
        return self.models.pick(name, None, MODEL_KEY) if name else None

    def need(self, kind: str, method: str, headers) -> str:
        """The name of the model the call names, checked to be of `kind` (ServedModel.kinds), else
        of the first model of `kind`; FAILED_PRECONDITION when it is not, or none is served."""
        named = self.named(headers)
        if named is not None:
            if kind not in named.kinds:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{method} needs {NEEDS[kind]}, and {MODEL_KEY} {named.name} is {KINDS[named.task]}")
            return named.name
        model = next((m for m in self.models.models if kind in m.kinds), None)
        if model is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{method} needs {NEEDS[kind]}, and none is served here; the models served: "
                               f"{self.models.served()}")
        return model.name

    async def call(self, context, method: str, request, work):
        """A unary method: the door as pollen.v1's, then `work(request)`, its RequestError the status."""
        await svc.refuse_unusable(context, request, method)
        return await svc.unary(context, method, work(request, context.invocation_metadata, method))

    # Info

    async def Info(self, request, context):
        return await self.call(context, "Info", request, self.info)

    async def info(self, request, headers, method) -> tei.InfoResponse:
        model, cfg = self.named(headers) or self.models.first, self.core.cfg
        return tei.InfoResponse(
            version=VERSION, model_id=model.name, model_dtype=cfg.worker_dtype(), model_type=MODEL_TYPE[model.task],
            max_concurrent_requests=cfg.grpc_max_pending_calls, max_input_length=model.spec.max_tokens,
            max_batch_tokens=cfg.max_batch_tokens, max_client_batch_size=cfg.max_texts_per_request,
            tokenization_workers=cfg.tokenizer_threads)

    # Embed

    async def Embed(self, request, context):
        return await self.call(context, "Embed", request, self.embed)

    async def EmbedStream(self, requests, context):
        async for response in self.stream(requests, context, "EmbedStream", self.embed):
            yield response

    async def embed(self, request: tei.EmbedRequest, headers, method) -> tei.EmbedResponse:
        started = time.monotonic_ns()
        answer = await self.embed_one(request, headers, method, "embed", normalize=request.normalize)
        return tei.EmbedResponse(embeddings=np.frombuffer(answer.embeddings, np.float32).tolist(),
                                 metadata=metadata(len(request.inputs), answer.usage.prompt_tokens, started,
                                                   answer.timing))

    async def embed_one(self, request, headers, method: str, kind: str, **fields) -> pb.EmbedResponse:
        """A TEI request's one text as pollen.v1's Embed on the first model of `kind`, its refusals
        in TEI's field names; `fields`: the EmbedRequest's other fields."""
        ours = pb.EmbedRequest(texts=[request.inputs], truncate=truncate_of(request), prompt_name=request.prompt_name,
                               model=self.need(kind, method, headers), **fields)
        try:
            return await self.core.embed(ours, "grpc", headers=headers, method=method)
        except RequestError as exc:
            raise renamed(exc, {"texts[0]": "inputs", "the request has neither texts nor token_ids nor chunks":
                                "inputs is empty"}) from None

    async def EmbedSparse(self, request, context):
        return await self.call(context, "EmbedSparse", request, self.embed_sparse)

    async def EmbedSparseStream(self, requests, context):
        async for response in self.stream(requests, context, "EmbedSparseStream", self.embed_sparse):
            yield response

    async def embed_sparse(self, request: tei.EmbedSparseRequest, headers, method) -> tei.EmbedSparseResponse:
        """The first sparse model's non-zero weights of one text, by ascending id."""
        started = time.monotonic_ns()
        answer = await self.embed_one(request, headers, method, "sparse", outputs=[pb.OUTPUT_SPARSE])
        ids = np.frombuffer(answer.sparse_indices, np.uint32).tolist()
        weights = np.frombuffer(answer.sparse_values, np.float32).tolist()
        values = [tei.SparseValue(index=i, value=w) for i, w in zip(ids, weights)]
        return tei.EmbedSparseResponse(sparse_embeddings=values, metadata=metadata(
            len(request.inputs), answer.usage.prompt_tokens, started, answer.timing))

    async def EmbedAll(self, request, context):
        return await self.call(context, "EmbedAll", request, self.embed_all)

    async def EmbedAllStream(self, requests, context):
        async for response in self.stream(requests, context, "EmbedAllStream", self.embed_all):
            yield response

    async def embed_all(self, request: tei.EmbedAllRequest, headers, method) -> tei.EmbedAllResponse:
        """Every token's last hidden state, special tokens included, not normalized (TEI's EmbedAll)."""
        started = time.monotonic_ns()
        answer = await self.embed_one(request, headers, method, "embed", normalize=False, outputs=[pb.OUTPUT_TOKENS])
        rows = np.frombuffer(answer.token_embeddings, np.float32).reshape(-1, answer.dims)
        return tei.EmbedAllResponse(token_embeddings=[tei.TokenEmbedding(embeddings=row.tolist()) for row in rows],
                                    metadata=metadata(len(request.inputs), answer.usage.prompt_tokens, started,
                                                      answer.timing))

    # Predict

    async def Predict(self, request, context):
        return await self.call(context, "Predict", request, self.predict)

    async def PredictStream(self, requests, context):
        async for response in self.stream(requests, context, "PredictStream", self.predict):
            yield response

    async def PredictPair(self, request, context):
        return await self.call(context, "PredictPair", request, self.predict_pair)

    async def PredictPairStream(self, requests, context):
        async for response in self.stream(requests, context, "PredictPairStream", self.predict_pair):
            yield response

    async def predict(self, request: tei.PredictRequest, headers, method) -> tei.PredictResponse:
        return await self.classify(method, headers, request, [request.inputs], [])

    async def predict_pair(self, request: tei.PredictPairRequest, headers, method) -> tei.PredictResponse:
        if len(request.inputs) not in (1, 2):
            raise invalid(f"inputs must have a single or two elements. Given: {len(request.inputs)}")
        return await self.classify(method, headers, request, request.inputs[:1], request.inputs[1:])

    async def classify(self, method, headers, request, texts, pairs) -> tei.PredictResponse:
        started = time.monotonic_ns()
        model = self.need("classify", method, headers)
        ours = pb.ClassifyRequest(texts=texts, text_pairs=pairs, raw_scores=request.raw_scores,
                                  truncate=truncate_of(request), model=model)
        try:
            answer = await self.core.classify(ours, "grpc", headers=headers)
        except RequestError as exc:
            raise renamed(exc, {"text_pairs[0]": "inputs[1]", "texts[0]": "inputs[0]" if pairs else "inputs"}) from None
        predictions = [tei.Prediction(score=s.score, label=s.label) for s in answer.results[0].labels]
        return tei.PredictResponse(predictions=predictions,
                                   metadata=metadata(sum(map(len, texts + pairs)), answer.usage.prompt_tokens,
                                                     started, answer.timing))

    # Rerank

    async def Rerank(self, request, context):
        return await self.call(context, "Rerank", request, self.rerank)

    async def rerank(self, request: tei.RerankRequest, headers, method) -> tei.RerankResponse:
        started = time.monotonic_ns()
        if not request.texts:
            raise invalid("texts cannot be empty")
        model = self.need("rerank", method, headers)
        ours = pb.RerankRequest(query=request.query, documents=request.texts, raw_scores=request.raw_scores,
                                truncate=truncate_of(request), model=model)
        try:
            answer = await self.core.rerank(ours, "grpc", headers=headers, method=method)
        except RequestError as exc:
            raise renamed(exc, {"documents": "texts"}) from None
        ranks = [tei.Rank(index=r.index, score=r.score, text=request.texts[r.index] if request.return_text else None)
                 for r in answer.results]
        chars = len(request.query) * len(request.texts) + sum(map(len, request.texts))
        return tei.RerankResponse(ranks=ranks, metadata=metadata(chars, answer.usage.prompt_tokens, started,
                                                                 answer.timing))

    async def RerankStream(self, requests, context):
        """Every pair a one-document rerank, answered as the pairs are read; one answer at the end."""
        started = time.monotonic_ns()
        first: list[tei.RerankStreamRequest] = []
        headers = context.invocation_metadata

        async def one(request, _headers, method):
            if not first:
                first.append(request)
            ours = tei.RerankRequest(query=request.query, texts=[request.text], truncate=request.truncate,
                                     raw_scores=first[0].raw_scores, truncation_direction=request.truncation_direction)
            return request, await self.rerank(ours, headers, method)

        try:
            self.need("rerank", "RerankStream", headers)
        except RequestError as exc:
            await svc.abort(context, exc)
        answers = [answer async for answer in self.stream(requests, context, "RerankStream", one)]
        if not answers:
            await svc.abort(context, invalid("the stream sent no (query, text) pair; texts cannot be empty"))
        return_text = first[0].return_text
        ranks = sorted((tei.Rank(index=i, score=r.ranks[0].score, text=q.text if return_text else None)
                        for i, (q, r) in enumerate(answers)), key=lambda rank: -rank.score)
        chars = sum(len(q.query) + len(q.text) for q, _ in answers)
        tokens = sum(r.metadata.compute_tokens for _, r in answers)
        n = len(answers)
        return tei.RerankResponse(ranks=ranks, metadata=tei.Metadata(
            compute_chars=chars, compute_tokens=tokens, total_time_ns=time.monotonic_ns() - started,
            tokenization_time_ns=sum(r.metadata.tokenization_time_ns for _, r in answers) // n,
            queue_time_ns=sum(r.metadata.queue_time_ns for _, r in answers) // n,
            inference_time_ns=sum(r.metadata.inference_time_ns for _, r in answers) // n))

    # Tokenize

    async def Tokenize(self, request, context):
        return await self.call(context, "Tokenize", request, self.tokenize)

    async def TokenizeStream(self, requests, context):
        async for response in self.stream(requests, context, "TokenizeStream", self.tokenize):
            yield response

    async def tokenize(self, request: tei.EncodeRequest, headers, method) -> tei.EncodeResponse:
        """The model's tokens for the text (its prompt first, when named), with TEI's offsets:
        UTF-8 bytes into the text tokenized; special tokens have none."""
        admission = (self.named(headers) or self.models.first).admission
        prompt = admission.prompt(request.prompt_name, "", admission.limit(0))
        text = prompt + request.inputs
        encoding = await admission.run(len(text), admission.tokenizer.tokenizer.encode, text, None,
                                       False, request.add_special_tokens)
        return tei.EncodeResponse(tokens=[
            tei.SimpleToken(**{k: v for k, v in token._asdict().items() if v is not None})
            for token in tei_tokens(text, encoding)])

    async def Decode(self, request, context):
        return await self.call(context, "Decode", request, self.decode)

    async def DecodeStream(self, requests, context):
        async for response in self.stream(requests, context, "DecodeStream", self.decode):
            yield response

    async def decode(self, request: tei.DecodeRequest, headers, method) -> tei.DecodeResponse:
        if not request.ids:
            raise invalid("ids is empty")
        model = self.named(headers) or self.models.first
        vocab = model.spec.vocab_size
        bad = next((i for i in request.ids if i >= vocab), None)
        if bad is not None:
            raise invalid(f"ids holds id {bad}, outside the vocabulary [0, {vocab})")
        admission = model.admission
        text = await admission.run(len(request.ids), admission.tokenizer.tokenizer.decode, list(request.ids),
                                   request.skip_special_tokens)
        return tei.DecodeResponse(text=text)

    # Streams

    async def stream(self, requests, context, method: str, work):
        """TEI's stream: each message's `work` answer, in the messages' order; the first failure
        ends the stream with its status."""
        call = OrderedStream(requests, self.core.cfg.max_stream_in_flight, method,
                             lambda request: work(request, context.invocation_metadata, method))
        self.core.streams.add(call)
        try:
            async for answer in call.answers():
                if isinstance(answer, RequestError):
                    await svc.abort(context, answer)
                yield answer
        finally:
            self.core.streams.discard(call)
        if call.stopped and not call.finished:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the server is stopping: the {call.received} messages "
                                "of this stream it read are answered; send the others again")


class OrderedStream:
    """One TEI stream call: a reader task takes messages while fewer than `window` are unanswered
    (read, and their answer not yet taken by gRPC) and starts each one's answer as a task;
    `answers` hands them on in the order read. A message that failed hands on its RequestError
    (the caller ends the stream with it); one that does not decode, INVALID_ARGUMENT; one over
    --max-request-bytes, RESOURCE_EXHAUSTED."""

    def __init__(self, requests, window: int, method: str, work):
        self.requests, self.method, self.work = requests, method, work
        self.slots = asyncio.Semaphore(window)
        self.pending: asyncio.Queue = asyncio.Queue()  # each message's task, in order; None at the end
        self.received = 0
        self.finished = False  # the client ended its side
        self.stopped = False  # the server stops: no more messages are read
        self.reader: asyncio.Task | None = None

    def stop_reading(self) -> None:
        """Read no more messages (the server stops); those read are still answered."""
        self.stopped = True
        if self.reader is not None:
            self.reader.cancel()

    async def answers(self):
        self.reader = asyncio.create_task(self.read())
        tasks = []
        try:
            while (task := await self.pending.get()) is not None:
                tasks.append(task)
                answer = await task
                yield answer
                if isinstance(answer, RequestError):
                    return
                self.slots.release()
        finally:
            self.reader.cancel()
            for task in tasks:
                task.cancel()
            while not self.pending.empty():
                if (task := self.pending.get_nowait()) is not None:
                    task.cancel()

    async def read(self) -> None:
        try:
            while not self.stopped:
                await self.slots.acquire()
                try:
                    request = await anext(self.requests)
                except StopAsyncIteration:
                    self.finished = True
                    return
                self.received += 1
                if isinstance(request, Undecodable):
                    where = f"message {self.received} of this stream"
                    self.pending.put_nowait(done(svc.undecodable(request, self.method, where)))
                    return
                if isinstance(request, Oversize):
                    self.pending.put_nowait(done(request.error(f"message {self.received} of this stream")))
                    return
                self.pending.put_nowait(asyncio.create_task(self.answer(request)))
        except asyncio.CancelledError:
            if not self.stopped:
                raise
        finally:
            self.pending.put_nowait(None)

    async def answer(self, request):
        try:
            return await self.work(request)
        except RequestError as exc:
            return exc
        except Exception as exc:  # a bug still ends the stream with a status that says so
            svc.log.exception("%s message %d failed", self.method, self.received)
            return RequestError(grpc.StatusCode.INTERNAL, f"internal error: {svc.cut(repr(exc))}")


def done(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future
