"""pollen.v1.Embedder over grpc.aio. RequestError becomes a status here and nowhere else.

The methods are registered by `add_to_server`, whose request deserializers never raise: bytes that
are not a valid request become an `Undecodable` the handler answers (INVALID_ARGUMENT), in order
with the stream's other messages, instead of an exception inside grpc (a bare UNKNOWN and an
ERROR traceback per call for unary calls, a stream ended silently with OK). A message over
--max-request-bytes becomes an `Oversize`, refused on its own (RESOURCE_EXHAUSTED; on a stream an
error answer with its id, the stream going on): gRPC itself only ends a call whose message is
over GRPC_LIMIT_FACTOR times that, since it can only end the whole call, losing the answers of
a stream's other messages. When the server has
API keys (server/auth.py), every method is registered behind `guarded`, which ends a call
without a valid `authorization` metadata UNAUTHENTICATED before the method sees it; the health
and reflection services are registered apart and stay open.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from pollen.common import encodings, status
from pollen.common.errors import RequestError, cut, echo, invalid
from pollen.common.throttled_log import ThrottledLog
from pollen.server import auth
from pollen.server.core import Core, model_info
from pollen.server.grpc_api.flood_guard import FloodGuard
from pollen.server.grpc_api.wire_fault import bad_field
from pollen.server.observe.metrics import TASK_OF, count_request
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc

log = logging.getLogger("pollen.service")

SERVICE = pb.DESCRIPTOR.services_by_name["Embedder"]
# Undecodable messages are logged at most once per this many seconds, with a count.
UNDECODABLE_LOG_INTERVAL_S = 10.0
# gRPC receives messages up to this many times --max-request-bytes (so that one a little over
# is refused alone, see the module docstring); the bound on one message's memory in a frontend.
GRPC_LIMIT_FACTOR = 2
# The methods whose calls count in pollen_requests_total (the others: Tokenize, Info).
COUNTED_METHODS = ("Embed", "EmbedStream", "Rerank", "RerankStream", "Classify")


@dataclass(slots=True)
class Undecodable:
    """Stands in for a request message whose bytes did not decode as its type."""

    type_name: str
    size: int
    reason: str  # protobuf's, without its "Error parsing message ...:" prefix
    field: str | None  # the field at fault (server/grpc_api/wire_fault.py), where one is


@dataclass(slots=True)
class Oversize:
    """Stands in for a request message over --max-request-bytes (its id kept, to answer by)."""

    size: int
    limit: int
    id: str

    def error(self, where: str = "the request") -> RequestError:
        return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{where} has {self.size} bytes, over the server's --max-request-bytes of "
                            f"{self.limit}; split it into smaller requests")


def lenient(message_type, max_bytes: int):
    """A request deserializer that returns an Undecodable (or an Oversize) instead of raising."""
    def decode(data: bytes):
        try:
            message = message_type.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever else bad bytes raise: never into grpc
            reason = str(exc).rpartition("': ")[2] or type(exc).__name__
            return Undecodable(message_type.DESCRIPTOR.full_name, len(data), reason, bad_field(message_type, data))
        if len(data) > max_bytes:
            return Oversize(len(data), max_bytes, getattr(message, "id", ""))
        return message
    return decode


def add_to_server(service: EmbedderService, server) -> None:
    """Register every Embedder method (read from the proto's descriptor) with lenient deserializers."""
    add_service(service, server, SERVICE, service)


def add_service(service: EmbedderService, server, descriptor, methods) -> None:
    """Register every method of the gRPC service `descriptor` as `methods`' method of its name
    (pollen.v1's: the EmbedderService; TEI's: server/grpc_api/tei.py), with lenient deserializers,
    held at the door while the frontend drains, behind the API keys and `service`'s flood guard."""
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    core, handlers = service.core, {}
    for method in descriptor.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        behavior = held(getattr(methods, method.name), core, method.server_streaming)
        if core.keys:
            behavior = guarded(behavior, core.keys, method.name, method.server_streaming)
        if service.flood_guard is not None:
            behavior = metered(behavior, service.flood_guard, method.client_streaming, method.server_streaming)
        handlers[method.name] = kinds[method.client_streaming, method.server_streaming](
            behavior, request_deserializer=lenient(request, core.cfg.max_request_bytes),
            response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))
    server.add_registered_method_handlers(descriptor.full_name, handlers)


def held(behavior, core: Core, server_streaming: bool):
    """`behavior` waiting at the core's door while the frontend drains (server/core.py `at_door`)."""
    if server_streaming:
        async def held_stream(request, context):
            if core.draining:
                await core.at_door()
            async for response in behavior(request, context):
                yield response
        return held_stream

    async def held_call(request, context):
        if core.draining:
            await core.at_door()
        return await behavior(request, context)
    return held_call


_undecodable_log = ThrottledLog(log, UNDECODABLE_LOG_INTERVAL_S)
_refused_log = ThrottledLog(log, UNDECODABLE_LOG_INTERVAL_S)


async def authorize(context, keys: auth.ApiKeys, method: str) -> None:
    """End the call UNAUTHENTICATED unless its `authorization` metadata carries one of the keys.
    An embedding call refused so counts in pollen_requests_total; the reason is logged
    (throttled) with the peer's address, never with what the client sent."""
    authorization = next((value for key, value in context.invocation_metadata() or () if key == "authorization"),
                         None)
    reason = keys.check(authorization)
    if reason is not None:
        if method in COUNTED_METHODS:
            count_request("grpc", grpc.StatusCode.UNAUTHENTICATED.name, task=TASK_OF[method])
        _refused_log.warning("%s from %s refused UNAUTHENTICATED: %s", method, context.peer(), reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)


def guarded(behavior, keys: auth.ApiKeys, method: str, server_streaming: bool):
    """`behavior` (a method of EmbedderService) behind the API keys."""
    if server_streaming:
        async def guarded_stream(request, context):
            await authorize(context, keys, method)
            async for response in behavior(request, context):
                yield response
        return guarded_stream

    async def guarded_call(request, context):
        await authorize(context, keys, method)
        return await behavior(request, context)
    return guarded_call


def message_bytes(message) -> int:
    return message.size if isinstance(message, (Undecodable, Oversize)) else message.ByteSize()


def metered(behavior, guard: FloodGuard, client_streaming: bool, server_streaming: bool):
    """`behavior` crediting its peer, in the flood guard (server/grpc_api/flood_guard.py), with the bytes of
    each message read and answered."""
    async def reading(requests, peer: str):
        async for request in requests:
            guard.read(peer, message_bytes(request))
            yield request

    def received(request, peer: str):
        """The request (a client stream: its messages) credited as it is read."""
        if client_streaming:
            return reading(request, peer)
        guard.read(peer, message_bytes(request))
        return request

    if server_streaming:
        async def metered_stream(request, context):
            peer = context.peer()
            request = received(request, peer)
            try:
                async for response in behavior(request, context):
                    guard.answered(peer, response.ByteSize())
                    yield response
            finally:
                guard.answered(peer, 0)  # the trailers
        return metered_stream

    async def metered_call(request, context):
        peer = context.peer()
        request = received(request, peer)
        response = None
        try:
            response = await behavior(request, context)
            return response
        finally:
            guard.answered(peer, response.ByteSize() if response is not None else 0)
    return metered_call


def undecodable(request: Undecodable, method: str, where: str = "the request") -> RequestError:
    """The refusal of an undecodable message, logged (throttled)."""
    _undecodable_log.warning("%s: %s (%d bytes) is not a valid %s: %s", method, where, request.size,
                             request.type_name, request.reason)
    at = f" in {request.field}" if request.field else ""
    return invalid(f"{where} is not a valid {request.type_name}: {request.reason[:1].lower()}{request.reason[1:]}{at}")


class EmbedderService(pb_grpc.EmbedderServicer):
    """pollen.v1.Embedder's methods: each translates its call for the core (server/core.py) and
    its answer, refusal or failure back into gRPC's terms."""

    def __init__(self, core: Core):
        self.core = core
        self.flood_guard: FloodGuard | None = None  # the frontend sets it for a TCP address

    async def Embed(self, request, context):
        await refuse_unusable(context, request, "Embed", counted=True)
        return await unary(context, "Embed", self.core.embed(request, "grpc", deadline_ns=call_deadline(context),
                                                        headers=context.invocation_metadata))

    async def EmbedStream(self, request_iterator, context):
        headers = context.invocation_metadata
        async for response in self.stream(request_iterator, context, "EmbedStream", embed_error, lambda request: (
                self.core.embed(request, "grpc", headers=headers, method="EmbedStream"))):
            yield response

    async def RerankStream(self, request_iterator, context):
        headers = context.invocation_metadata
        async for response in self.stream(request_iterator, context, "RerankStream", rerank_error, lambda request: (
                self.core.rerank(request, "grpc", headers=headers, method="RerankStream"))):
            yield response

    async def stream(self, request_iterator, context, method: str, error: ErrorAnswer, answer: Answer):
        """A stream's answers (EmbedStream, RerankStream): each message's `answer` as soon as it
        is done; a bad message gets an `error` answer only. One that does not decode ends the
        stream INVALID_ARGUMENT, after the earlier ones' answers; one over --max-request-bytes
        gets an error answer only (RESOURCE_EXHAUSTED). When the frontend stops, the stream reads
        no more: the messages read are answered, then a stream the client had not finished ends
        UNAVAILABLE."""
        stream = StreamCall(request_iterator, self.core.cfg.max_stream_in_flight, method, answer, error,
                            self.core.draining)
        self.core.streams.add(stream)
        try:
            async for response in stream.responses():
                yield response
        finally:
            self.core.streams.discard(stream)
        if stream.stopped and not stream.finished:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the server is stopping: the {stream.received} messages "
                                "of this stream it read are answered; send the others again")
        if stream.undecodable is not None:
            count_request("grpc", grpc.StatusCode.INVALID_ARGUMENT.name, task=TASK_OF[method])
            await abort(context, undecodable(stream.undecodable, method,
                                             f"message {stream.received} of this stream"))
        if stream.failure is not None:
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error reading the stream: {stream.failure!r}")

    async def Tokenize(self, request, context):
        await refuse_unusable(context, request, "Tokenize")
        return await unary(context, "Tokenize", self.core.tokenize(request))

    async def Info(self, request, context):
        await refuse_unusable(context, request, "Info")
        cfg = self.core.cfg
        models = [model_info(model) for model in self.core.models.models]
        first = models[0]
        return pb.InfoResponse(
            model=first.name, dimensions=first.dimensions, max_tokens=first.max_tokens, pooling=first.pooling,
            encodings=list(encodings.SUPPORTED),
            max_texts_per_request=cfg.max_texts_per_request, max_batch_tokens=cfg.max_batch_tokens,
            max_queued_tokens=cfg.max_queued_tokens, max_request_bytes=cfg.max_request_bytes,
            vocab_size=first.vocab_size, workers=cfg.workers, device=cfg.device,
            frontends=cfg.frontends, frontend=self.core.frontend,
            prompts=dict(first.prompts), matryoshka_dimensions=list(first.matryoshka_dimensions),
            task=first.task, labels=list(first.labels), models=models)

    async def Rerank(self, request, context):
        await refuse_unusable(context, request, "Rerank", counted=True)
        return await unary(context, "Rerank", self.core.rerank(request, "grpc", call_deadline(context),
                                                          headers=context.invocation_metadata))

    async def Classify(self, request, context):
        await refuse_unusable(context, request, "Classify", counted=True)
        return await unary(context, "Classify", self.core.classify(request, "grpc", call_deadline(context),
                                                              headers=context.invocation_metadata))


def call_deadline(context) -> int:
    """The gRPC call's deadline as CLOCK_MONOTONIC ns (0: none)."""
    remaining = context.time_remaining()
    return time.monotonic_ns() + int(remaining * 1e9) if remaining is not None else 0


async def abort(context, exc: RequestError):
    await context.abort(exc.code, exc.message)


async def refuse_unusable(context, request, method: str, *, counted: bool = False) -> None:
    """End a unary call whose message did not decode (INVALID_ARGUMENT) or is over
    --max-request-bytes (RESOURCE_EXHAUSTED); `counted`: in pollen_requests_total (the embedding
    method). Any other request passes."""
    if isinstance(request, Undecodable):
        exc = undecodable(request, method)
    elif isinstance(request, Oversize):
        exc = request.error()
    else:
        return
    if counted:
        count_request("grpc", exc.code.name, task=TASK_OF[method])
    await abort(context, exc)


async def unary(context, method: str, work):
    """Await a unary method's work; RequestError becomes its status, a bug becomes INTERNAL."""
    try:
        return await work
    except RequestError as exc:
        await abort(context, exc)
    except Exception as exc:  # never a bare UNKNOWN: say it is ours, and log it
        log.exception("%s failed", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {cut(repr(exc))}")


def error_of(exc: RequestError) -> pb.Error:
    return pb.Error(code=status.number_of(exc.code), message=exc.message)


def embed_error(request_id: str, exc: RequestError) -> pb.EmbedResponse:
    return pb.EmbedResponse(id=request_id, error=error_of(exc))


def rerank_error(request_id: str, exc: RequestError) -> pb.RerankResponse:
    return pb.RerankResponse(id=request_id, error=error_of(exc))


# A stream's answer to one of its messages, and the answer of a message that failed.
Answer = Callable[[Message], Awaitable[Message]]
ErrorAnswer = Callable[[str, RequestError], Message]


class StreamCall:
    """One EmbedStream or RerankStream call: `answer` answers a message, `error` builds the
    answer of one that failed. A reader task takes messages while fewer than `window` are
    unanswered (read, and their answer not yet handed to gRPC); each accepted message is answered
    by its own task. A client that reads no answers therefore stops the reader once `window`
    answers wait: gRPC's flow control then pushes back on the client's writes, and the stream
    holds at most `window` messages and answers."""

    def __init__(self, requests, window: int, method: str, answer: Answer, error: ErrorAnswer,
                 stopped: bool = False):
        self.requests = requests
        self.method = method
        self.respond, self.error = answer, error
        self.slots = asyncio.Semaphore(window)  # one per unanswered message
        self.answers: asyncio.Queue = asyncio.Queue()  # at most `window` long, by the slots
        self.in_flight: set[str] = set()
        self.tasks: set[asyncio.Task] = set()
        self.received = 0
        self.finished = False  # the client ended its side: every message was read
        self.stopped = stopped  # the server stops: no more messages are read
        self.reading = False   # the reader waits for a slot or the next message
        self.reader: asyncio.Task | None = None
        self.undecodable: Undecodable | None = None  # the message that ended the stream
        self.failure: Exception | None = None  # reading the stream failed (a bug, or gRPC's)

    async def responses(self):
        """The answers in the order they are done; ends once every message read is answered."""
        self.reader = asyncio.create_task(self.read())
        try:
            while (response := await self.answers.get()) is not None:
                yield response
                self.slots.release()  # gRPC took the answer: the reader may take one more message
        finally:
            self.reader.cancel()
            for task in list(self.tasks):
                task.cancel()

    def stop_reading(self) -> None:
        """Read no more messages (the server stops); those read are still answered."""
        self.stopped = True
        if self.reading:
            self.reader.cancel()

    async def next_request(self):
        """The next message, once a slot is free; None once the client ends or the server stops."""
        self.reading = True
        try:
            await self.slots.acquire()
            return None if self.stopped else await anext(self.requests)
        except StopAsyncIteration:
            self.finished = True
            return None
        except asyncio.CancelledError:
            if not self.stopped:
                raise
            return None
        finally:
            self.reading = False

    async def read(self) -> None:
        try:
            while (request := await self.next_request()) is not None:
                self.received += 1
                if isinstance(request, Undecodable):
                    self.undecodable = request
                    break
                if isinstance(request, Oversize):
                    self.refuse(self.error(request.id, request.error(f"message {self.received} of this stream")),
                                grpc.StatusCode.RESOURCE_EXHAUSTED)
                    continue
                self.accept(request)
            while self.tasks:
                await asyncio.wait(set(self.tasks))
        except Exception as exc:
            log.exception("reading a %s failed", self.method)
            self.failure = exc
        finally:
            self.answers.put_nowait(None)

    def accept(self, request: Message) -> None:
        if not request.id:
            self.refuse(self.error("", invalid(f"id is required on {self.method} messages")))
        elif request.id in self.in_flight:
            self.refuse(self.error(request.id, invalid(
                f"id {echo(request.id)} is still in flight on this stream; ids must be unique until answered")))
        else:
            self.in_flight.add(request.id)
            task = asyncio.create_task(self.answer(request))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def refuse(self, response: Message, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        count_request("grpc", code.name, task=TASK_OF[self.method])
        self.answers.put_nowait(response)

    async def answer(self, request: Message) -> None:
        try:
            response = await self.respond(request)
        except RequestError as exc:
            response = self.error(request.id, exc)
        except Exception as exc:  # a bug must still answer the message, and say so
            log.exception("stream message %r failed", request.id)
            response = self.error(request.id, RequestError(grpc.StatusCode.INTERNAL,
                                                           f"internal error: {cut(repr(exc))}"))
        finally:
            self.in_flight.discard(request.id)
        self.answers.put_nowait(response)
