"""The asyncio client: the same calls as Client, awaited."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence

import grpc

from pollen.client.connections import CONNECTION_ARG, IN_FLIGHT, Connections
from pollen.client.messages import (
    EmbedError,
    Results,
    Vectors,
    auth_metadata,
    build_request,
    classify_request,
    concatenate,
    decode,
    decode_sparse,
    decode_tokens,
    label_scores,
    ranks,
    split,
)
from pollen.client.ordering import StreamOrder
from pollen.client.reconnect import Reconnects
from pollen.client.targets import channel_options as options_with
from pollen.client.targets import channel_target, describe
from pollen.v1 import embedder_pb2 as pb

# How long the probe after a failed write waits for Info.
PROBE_TIMEOUT_S = 10.0


class AsyncClient:
    """`async with AsyncClient("host:port") as client: await client.embed([...])`; replicas,
    `api_key` and `connections` as Client takes them."""

    def __init__(self, target: str | Sequence[str] = "127.0.0.1:50051", *, timeout: float | None = 300.0,
                 channel_options: Sequence[tuple] = (), api_key: str | None = None, connections: int = 0):
        self.target = describe(target)
        self.timeout = timeout
        self._metadata = auth_metadata(api_key)
        resolved = channel_target(target)
        self._connections = Connections(lambda i: grpc.aio.insecure_channel(
            resolved, options=options_with([*channel_options, (CONNECTION_ARG, i)])), connections)
        self._info: pb.InfoResponse | None = None

    async def info(self) -> pb.InfoResponse:
        if self._info is None:
            try:
                info = await self._connections.next()[1].Info(pb.InfoRequest(), timeout=self.timeout,
                                                              metadata=self._metadata)
            except grpc.RpcError as exc:  # fail fast, as Client.info
                raise EmbedError.from_rpc(exc, self.target) from None
            self._connections.fit(info.frontends)
            self._info = info
        return self._info

    async def embed(self, texts: str | Sequence[str], **options) -> Vectors:
        """As Client.embed; the pieces over max_texts_per_request are sent concurrently."""
        return concatenate([decode(reply, len(piece)) for piece, reply in await self._replies(texts, options)])

    async def embed_tokens(self, texts: str | Sequence[str], **options) -> Results:
        """As Client.embed_tokens; the pieces over max_texts_per_request are sent concurrently."""
        replies = await self._replies(texts, options, ("tokens",))
        return Results([rows for piece, reply in replies for rows in decode_tokens(reply, len(piece))],
                       replies[0][1].model)

    async def embed_sparse(self, texts: str | Sequence[str], **options) -> Results:
        """As Client.embed_sparse; the pieces over max_texts_per_request are sent concurrently."""
        tokens = bool(options.get("sparse_tokens"))
        replies = await self._replies(texts, options, ("sparse",))
        return Results([row for piece, reply in replies for row in decode_sparse(reply, len(piece), tokens)],
                       replies[0][1].model)

    async def _replies(self, texts, options: dict,
                       outputs: tuple = ("dense",)) -> list[tuple[list[str], pb.EmbedResponse]]:
        """(texts, Embed reply) per max_texts_per_request texts, in order, sent concurrently: IN_FLIGHT
        at most on each connection, each piece on the next connection as it is sent."""
        pieces = split(texts, (await self.info()).max_texts_per_request)
        slots = asyncio.Semaphore(IN_FLIGHT * len(self._connections.pairs))

        async def reply(piece) -> pb.EmbedResponse:
            async with slots:
                return await self._connections.next()[1].Embed(build_request(piece, outputs=outputs, **options),
                                                               timeout=self.timeout, metadata=self._metadata)
        try:
            replies = await asyncio.gather(*(reply(p) for p in pieces))
        except grpc.RpcError as exc:
            raise EmbedError.from_rpc(exc, self.target) from None
        return list(zip(pieces, replies))

    async def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None, *, model: str = "",
                     **options) -> Results:
        """As Client.rerank."""
        request = pb.RerankRequest(query=query, documents=list(documents), top_n=top_n, model=model, **options)
        try:
            reply = await self._connections.next()[1].Rerank(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise EmbedError.from_rpc(exc, self.target) from None
        return ranks(reply, len(request.documents), top_n)

    async def classify(self, texts: str | Sequence[str], text_pairs: Sequence[str] | None = None, *,
                       model: str = "", **options) -> Results:
        """As Client.classify."""
        request = classify_request(texts, text_pairs, model=model, **options)
        try:
            reply = await self._connections.next()[1].Classify(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise EmbedError.from_rpc(exc, self.target) from None
        return label_scores(reply, len(request.texts))

    async def embed_stream(self, inputs: Iterable | AsyncIterable, *, in_flight: int = 16,
                           reconnect_within: float = 60.0, **options) -> AsyncIterator[Vectors]:
        """As Client.embed_stream; `inputs` may be a plain or an async iterable."""
        order = StreamOrder(options, in_flight)
        source = _aiter(inputs)
        retries = Reconnects(self.target, reconnect_within)
        while not order.finished:
            channel, stub = self._connections.next()
            await self._wait_for_server(channel, reconnect_within)  # bounded; then a call that fails fast
            call = stub.EmbedStream(metadata=self._metadata)
            try:
                for message in order.resend():
                    await _write(call, message)
                while not order.finished:
                    while order.room > 0:
                        try:
                            await _write(call, order.add(await anext(source)))
                        except StopAsyncIteration:
                            order.inputs_done = True
                            await call.done_writing()
                    for rows in order.ready():
                        yield rows
                    if order.unanswered:
                        response = await call.read()
                        if response is grpc.aio.EOF:  # the server closed the stream early
                            raise _Lost()
                        order.accept(response)
            except (grpc.RpcError, asyncio.InvalidStateError, _Lost, _WriteFailed) as exc:
                if isinstance(exc, _WriteFailed):
                    # grpc.aio replaces the status of a call whose write fails as the call ends
                    # with a bare INTERNAL (grpc/grpc#36066): the server's own word is lost, so
                    # ask the server itself whether it is there and takes our calls.
                    code, details = await self._probe(stub, exc.error)
                else:
                    code = await _status(call, exc)
                    details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise EmbedError(code, details) from None
                await asyncio.sleep(retries.lost(order.answered, details))
            finally:
                call.cancel()

    async def _probe(self, stub, error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
        """After a stream was lost to a failed write: UNAVAILABLE (reconnect and resend) when the
        server answers Info or cannot be reached, else Info's refusal (a key it no longer takes,
        say), which the stream would have met as well."""
        try:
            await stub.Info(pb.InfoRequest(), timeout=PROBE_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return grpc.StatusCode.UNAVAILABLE, exc.details()
            return exc.code(), exc.details()
        return grpc.StatusCode.UNAVAILABLE, error.details()

    async def _wait_for_server(self, channel: grpc.aio.Channel, within: float) -> None:
        try:
            await asyncio.wait_for(channel.channel_ready(), within)
        except TimeoutError:
            raise EmbedError(grpc.StatusCode.UNAVAILABLE,
                             f"no connection to {self.target} within {within} s; stream abandoned") from None

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self._connections.channels))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _status(call, exc: Exception) -> grpc.StatusCode:
    """Why the stream failed, when no write did (a failed write: see _probe): the call's own
    status (UNAVAILABLE, say); a stream that ended early without one counts as UNAVAILABLE."""
    if isinstance(exc, _Lost):
        return grpc.StatusCode.UNAVAILABLE
    try:
        return await asyncio.wait_for(call.code(), 5.0)
    except (TimeoutError, grpc.RpcError, asyncio.CancelledError):
        return exc.code() if isinstance(exc, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE


class _Lost(Exception):
    """The stream ended with messages unanswered."""


class _WriteFailed(Exception):
    """A write into the stream failed; `error` is what grpc.aio raised (its status unreliable)."""

    def __init__(self, error: grpc.RpcError):
        super().__init__(error)
        self.error = error


async def _write(call, message: pb.EmbedRequest) -> None:
    try:
        await call.write(message)
    except grpc.RpcError as exc:
        raise _WriteFailed(exc) from None


async def _aiter(inputs):
    if hasattr(inputs, "__aiter__"):
        async for item in inputs:
            yield item
    else:
        for item in inputs:
            yield item
