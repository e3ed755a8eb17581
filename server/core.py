"""The frontend's core: what every door asks of the server, in one place. The doors (gRPC:
server/grpc_api, HTTP: server/http_api, each serving pollen's API and TEI's) translate their
messages into pollen.v1's and call the core; the core admits, routes and answers through the
pipeline (server/pipeline) and the tasks (server/tasks), counts each request in the door's
metrics, traces it with --otlp-endpoint, and holds new calls while the frontend drains.

May import: the pipeline, the tasks, server/model_table.py, server/config.py, server/auth.py and
server/observe; never a door.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from pollen.common import encodings
from pollen.common.errors import RequestError
from pollen.common.request import RequestOptions
from pollen.server import auth
from pollen.server.config import ServeConfig
from pollen.server.model_table import ModelTable, ServedModel
from pollen.server.observe import metrics
from pollen.server.observe.metrics import count_request
from pollen.server.pipeline.router import Router
from pollen.server.tasks import bge_m3, sparse_vectors, token_vectors
from pollen.shared_mem import records
from pollen.v1 import embedder_pb2 as pb

_POOLING = {"mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS, "last": pb.POOLING_LAST}


class Core:
    """Embed, rerank, classify and tokenize for every door, counted and traced; held while the
    frontend drains (`drain`, `at_door`)."""

    def __init__(self, cfg: ServeConfig, models: ModelTable, router: Router, frontend: int = 0):
        self.cfg = cfg
        self.models = models  # every served model by name (server/model_table.py)
        self.router = router
        self.frontend = frontend  # this process's index among the frontends
        self.keys = auth.inherited()  # API keys both doors ask for (none: no authentication)
        # server/observe/otel.py's RequestTracer with --otlp-endpoint (the frontend sets it: server/observe/tracing.py)
        self.tracer = None
        self.draining = False  # the frontend is stopping: streams read no more messages
        # The doors' streams in progress (pollen's and TEI's): each stops reading when we drain.
        self.streams: set = set()
        # Set once gRPC takes no more calls: a gRPC call that arrives while the frontend drains
        # waits at this door until then (see Frontend.shutdown), and then goes on.
        self.door_open = asyncio.Event()
        self.last_arrival = 0.0  # time.monotonic() when the last call reached the door

    async def respond(self, request: pb.EmbedRequest, deadline_ns: int, span, max_inputs: int = 0) -> pb.EmbedResponse:
        """Admit, route and answer one EmbedRequest (uncounted: `embed` counts). deadline_ns:
        CLOCK_MONOTONIC ns by which the request must reach the model (0: none); the request's own
        timeout_ms, counted from now, applies as well. span: the request's server/observe/otel.py
        RequestSpan when tracing, told when admission is done. max_inputs: the inputs the request
        may hold (0: --max-texts-per-request; the OpenAI route's is --max-openai-inputs)."""
        model = self.models.pick(request.model, "embed", "Embed")
        deadline_ns = RequestOptions.deadline(deadline_ns, request.timeout_ms)
        started_ns = time.monotonic_ns()
        try:
            admitted = await model.admission.admit(request, deadline_ns, max_inputs)
        except asyncio.CancelledError:
            metrics.DROPPED.labels(reason="cancelled").inc()  # the client left while we tokenized
            raise
        tokenize_us = (time.monotonic_ns() - started_ns) // 1000
        if span is not None:
            span.admitted()
        result = await self.router.answer(admitted)
        wanted = admitted.wanted
        if model.spec.bge_m3 and (wanted.tokens or wanted.sparse):
            fields = bge_m3.answer_fields(request, model.spec, admitted.seqs, result, wanted)
        elif wanted.tokens:
            fields = token_vectors.answer_fields(request, model.spec, admitted.seqs, result, wanted.dense)
        elif wanted.sparse:
            fields = sparse_vectors.answer_fields(request, model.spec, result)
        else:
            fields = dense_fields(result)
        if request.sparse_tokens:
            fields["sparse_tokens"] = sparse_vectors.token_strings(model.admission.tokenizer, fields["sparse_indices"])
        return pb.EmbedResponse(
            id=request.id, usage=pb.Usage(prompt_tokens=admitted.tokens),
            timing=pb.Timing(queue_us=result.queue_us, inference_us=result.inference_us, tokenize_us=tokenize_us),
            model=model.name, **fields)

    def drain(self) -> None:
        """The frontend stops: every stream stops reading (what each has read is still answered),
        and gRPC calls that arrive from now on wait at the door."""
        self.draining = True
        self.last_arrival = time.monotonic()
        for stream in list(self.streams):
            stream.stop_reading()

    async def at_door(self) -> None:
        """Hold a gRPC call that arrived while the frontend drains until gRPC takes no more."""
        self.last_arrival = time.monotonic()
        await self.door_open.wait()

    def quiet_for(self, seconds: float) -> bool:
        """No call has reached the door for `seconds` (a draining frontend's test)."""
        return time.monotonic() - self.last_arrival >= seconds

    async def embed(self, request: pb.EmbedRequest, door: str, *, headers=None, method: str = "Embed",
                    span=None, deadline_ns: int = 0, max_inputs: int = 0) -> pb.EmbedResponse:
        """One embedding request through either door: respond(), counted in the door's request,
        text and token metrics. With a tracer, the call runs in a span (server/observe/otel.py) whose
        parent is the trace context in `headers` (gRPC's invocation_metadata method, or HTTP's
        header dict; `method` names the gRPC call); the tracer calls back here with the `span`."""
        if span is None and self.tracer is not None:
            return await self.tracer.trace(self.embed, request, door, headers, method, deadline_ns=deadline_ns,
                                           max_inputs=max_inputs)
        response = await counted(door, self.respond(request, deadline_ns, span, max_inputs), "embed")
        count_request(door, "ok", response.rows, response.usage.prompt_tokens)
        return response

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        seqs = await self.models.pick(request.model, None, "Tokenize").admission.admit_tokenize(request)
        return pb.TokenizeResponse(tokens=[pb.TokenIds(ids=s.tolist()) for s in seqs],
                                   counts=[len(s) for s in seqs],
                                   usage=pb.Usage(prompt_tokens=sum(len(s) for s in seqs)))

    async def rerank(self, request: pb.RerankRequest, door: str, deadline_ns: int = 0, *, headers=None,
                     method: str = "Rerank", route: str = "/v1/rerank", span=None) -> pb.RerankResponse:
        """One rerank request through either door (server/tasks/rerank.py), counted in the door's
        metrics; in a span of its own with a tracer (as `embed`)."""
        if span is None and self.tracer is not None:
            return await self.tracer.trace(self.rerank, request, door, headers, method, route=route, task="rerank",
                                           deadline_ns=deadline_ns)
        response = await counted(door, self.ranked(request, deadline_ns, span), "rerank")
        count_request(door, "ok", len(request.documents), response.usage.prompt_tokens, "rerank")
        return response

    async def ranked(self, request: pb.RerankRequest, deadline_ns: int, span=None) -> pb.RerankResponse:
        return await self.models.pick(request.model, "rerank", "Rerank").ranker.rerank(request, deadline_ns, span)

    async def classify(self, request: pb.ClassifyRequest, door: str, deadline_ns: int = 0, *, headers=None,
                       span=None) -> pb.ClassifyResponse:
        """One classify request through either door (server/tasks/classify.py), counted in the door's
        metrics; in a span of its own with a tracer (as `embed`)."""
        if span is None and self.tracer is not None:
            return await self.tracer.trace(self.classify, request, door, headers, "Classify", route="/v1/classify",
                                           task="classify", deadline_ns=deadline_ns)
        response = await counted(door, self.classified(request, deadline_ns, span), "classify")
        count_request(door, "ok", len(request.texts), response.usage.prompt_tokens, "classify")
        return response

    async def classified(self, request: pb.ClassifyRequest, deadline_ns: int, span=None) -> pb.ClassifyResponse:
        model = self.models.pick(request.model, "classify", "Classify")
        return await model.classifier.classify(request, deadline_ns, span)


def dense_fields(result: records.ResultRecord) -> dict:
    """An EmbedResponse's vectors as the worker encoded them (int8: the scales apart)."""
    body, scales = result.body, ()
    if result.encoding == pb.ENCODING_INT8:
        body, scale_array = encodings.split_int8(body, result.rows, result.dims)
        scales = scale_array.tolist()
    return {"embeddings": body, "rows": result.rows, "dims": result.dims, "encoding": result.encoding,
            "scales": scales}


def model_info(model: ServedModel) -> pb.ModelInfo:
    spec = model.spec
    return pb.ModelInfo(name=spec.name, task=spec.task, dimensions=model.dimensions, max_tokens=spec.max_tokens,
                        pooling=_POOLING.get(spec.pooling, pb.POOLING_UNSPECIFIED), vocab_size=spec.vocab_size,
                        prompts=dict(spec.prompts), matryoshka_dimensions=list(spec.matryoshka_dimensions),
                        labels=list(spec.labels), sparse=spec.sparse, quantization=model.quantization)


async def counted(door: str, work, task: str):
    """`work`'s answer; a refusal, a cancel (the client left, or we stop) or a failure counted in
    the door's requests of `task` by its status (the caller counts the answer, with its rows and
    tokens)."""
    try:
        return await work
    except RequestError as exc:
        count_request(door, exc.code.name, task=task)
        raise
    except asyncio.CancelledError:
        count_request(door, grpc.StatusCode.CANCELLED.name, task=task)
        raise
    except Exception:
        count_request(door, grpc.StatusCode.INTERNAL.name, task=task)
        raise
