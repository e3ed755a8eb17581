"""pollen.v1.Embedder over grpc.aio. RequestError becomes a status here and nowhere else."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pollen.common import encodings, status
from pollen.common.model_spec import ModelSpec
from pollen.server import metrics
from pollen.server.admission import Admission
from pollen.server.config import ServeConfig
from pollen.server.errors import RequestError, cut, echo, invalid
from pollen.server.metrics import count_request
from pollen.server.router import Router
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc

log = logging.getLogger("pollen.service")

_POOLING = {"mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS, "last": pb.POOLING_LAST}


class EmbedderService(pb_grpc.EmbedderServicer):
    def __init__(self, cfg: ServeConfig, spec: ModelSpec, admission: Admission, router: Router, frontend: int = 0):
        self.cfg = cfg
        self.spec = spec
        self.admission = admission
        self.router = router
        self.frontend = frontend  # this process's index among the frontends
        self.active = 0       # embedding calls in progress (both doors)
        self.last_call = 0.0  # time.monotonic() when the last one began

    async def embed(self, request: pb.EmbedRequest, *, deadline_ns: int = 0) -> pb.EmbedResponse:
        """deadline_ns: CLOCK_MONOTONIC ns by which the request must reach the model (0: none);
        the request's own timeout_ms, counted from now, applies as well."""
        if request.timeout_ms:
            own = time.monotonic_ns() + request.timeout_ms * 1_000_000
            deadline_ns = min(deadline_ns, own) if deadline_ns else own
        try:
            job = await self.admission.admit(request)
        except asyncio.CancelledError:
            metrics.DROPPED.labels(reason="cancelled").inc()  # the client left while we tokenized
            raise
        result = await self.router.embed(job.seqs, job.dims, job.normalize, job.encoding, rows=job.rows,
                                       priority=job.priority, deadline_ns=deadline_ns)
        if result.status:
            raise RequestError(status.code_of(result.status, grpc.StatusCode.INTERNAL),
                               result.body.decode(errors="replace"))
        body, scales = result.body, ()
        if result.encoding == pb.ENCODING_INT8:
            body, scale_array = encodings.split_int8(body, result.rows, result.dims)
            scales = scale_array.tolist()
        return pb.EmbedResponse(
            id=request.id, embeddings=body, rows=result.rows, dims=result.dims,
            encoding=result.encoding, usage=pb.Usage(prompt_tokens=job.tokens),
            timing=pb.Timing(queue_us=result.queue_us, inference_us=result.inference_us), scales=scales)

    def quiet_for(self, seconds: float) -> bool:
        """No call in progress, and none begun in the last `seconds` (a draining frontend's test)."""
        return self.active == 0 and time.monotonic() - self.last_call >= seconds

    async def counted_embed(self, request: pb.EmbedRequest, door: str, **kwargs) -> pb.EmbedResponse:
        """embed(), counted in the door's request, text and token metrics."""
        self.active += 1
        self.last_call = time.monotonic()
        try:
            response = await self.embed(request, **kwargs)
        except RequestError as exc:
            count_request(door, exc.code.name)
            raise
        except asyncio.CancelledError:  # the client left (or we stop): counted, not answered
            count_request(door, grpc.StatusCode.CANCELLED.name)
            raise
        except Exception:
            count_request(door, grpc.StatusCode.INTERNAL.name)
            raise
        finally:
            self.active -= 1
        count_request(door, "ok", response.rows, response.usage.prompt_tokens)
        return response

    async def Embed(self, request, context):
        remaining = context.time_remaining()
        deadline_ns = time.monotonic_ns() + int(remaining * 1e9) if remaining is not None else 0
        return await unary(context, "Embed", self.counted_embed(request, "grpc", deadline_ns=deadline_ns))

    async def EmbedStream(self, request_iterator, context):
        """Answer each message as soon as it is done; a bad message gets an error answer only."""
        answers: asyncio.Queue = asyncio.Queue()
        in_flight: set[str] = set()
        tasks: set[asyncio.Task] = set()

        async def answer(request: pb.EmbedRequest) -> None:
            try:
                response = await self.counted_embed(request, "grpc")
            except RequestError as exc:
                response = error_response(request.id, exc)
            except Exception as exc:  # a bug must still answer the message, and say so
                log.exception("stream message %s failed", echo(request.id))
                response = error_response(request.id, RequestError(grpc.StatusCode.INTERNAL,
                                                                   f"internal error: {cut(repr(exc))}"))
            finally:
                in_flight.discard(request.id)
            answers.put_nowait(response)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    if not request.id:
                        count_request("grpc", grpc.StatusCode.INVALID_ARGUMENT.name)
                        answers.put_nowait(error_response("", invalid("id is required on EmbedStream messages")))
                    elif request.id in in_flight:
                        count_request("grpc", grpc.StatusCode.INVALID_ARGUMENT.name)
                        answers.put_nowait(error_response(request.id, invalid(
                            f"id {echo(request.id)} is still in flight on this stream; ids must be unique "
                            "until answered")))
                    else:
                        in_flight.add(request.id)
                        task = asyncio.create_task(answer(request))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.wait(set(tasks))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await answers.get()) is not None:
                yield response
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def Tokenize(self, request, context):
        return await unary(context, "Tokenize", self.tokenize(request))

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        seqs = await self.admission.admit_tokenize(request)
        return pb.TokenizeResponse(tokens=[pb.TokenIds(ids=s.tolist()) for s in seqs],
                                   counts=[len(s) for s in seqs],
                                   usage=pb.Usage(prompt_tokens=sum(len(s) for s in seqs)))

    async def Info(self, request, context):
        return pb.InfoResponse(
            model=self.spec.name, dimensions=self.spec.hidden_size, max_tokens=self.spec.max_tokens,
            pooling=_POOLING.get(self.spec.pooling, pb.POOLING_UNSPECIFIED), encodings=list(encodings.SUPPORTED),
            max_texts_per_request=self.cfg.max_texts_per_request, max_batch_tokens=self.cfg.max_batch_tokens,
            max_queued_tokens=self.cfg.max_queued_tokens, max_request_bytes=self.cfg.max_request_bytes,
            vocab_size=self.spec.vocab_size, workers=self.cfg.workers, device=self.cfg.device,
            frontends=self.cfg.frontends, frontend=self.frontend,
            prompts=dict(self.spec.prompts), matryoshka_dimensions=list(self.spec.matryoshka_dimensions))


async def unary(context, method: str, work):
    """Await a unary method's work; RequestError becomes its status, a bug becomes INTERNAL."""
    try:
        return await work
    except RequestError as exc:
        await context.abort(exc.code, exc.message)
    except Exception as exc:  # never a bare UNKNOWN: say it is ours, and log it
        log.exception("%s failed", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {cut(repr(exc))}")


def error_response(request_id: str, exc: RequestError) -> pb.EmbedResponse:
    return pb.EmbedResponse(id=request_id, error=pb.Error(code=status.number_of(exc.code), message=exc.message))
