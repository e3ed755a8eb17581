"""The blocking client."""
from __future__ import annotations

import queue
import time
from collections.abc import Iterable, Iterator, Sequence

import grpc

from pollen.client.connections import CONNECTION_ARG, Connections
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


class Client:
    """`Client("host:port")`: embed() for lists of texts, embed_stream() for long iterables.
    Replicas: `Client(["host1:50051", "host2:50051"])`, "host1:50051,host2:50051" or
    "dns:///name:50051"; calls are balanced round robin over them (client/targets.py).
    `api_key`: for a server started with --api-key; sent with every call as the `authorization`
    metadata (Bearer KEY). `connections`: how many connections (gRPC channels) the calls take in
    turn, so that they reach several of the server's frontend processes; 0 follows the server's
    frontends (client/connections.py). The client may be used from several threads."""

    def __init__(self, target: str | Sequence[str] = "127.0.0.1:50051", *, timeout: float | None = 300.0,
                 channel_options: Sequence[tuple] = (), api_key: str | None = None, connections: int = 0):
        self.target = describe(target)
        self.timeout = timeout
        self._metadata = auth_metadata(api_key)
        resolved = channel_target(target)
        self._connections = Connections(lambda i: grpc.insecure_channel(
            resolved, options=options_with([*channel_options, (CONNECTION_ARG, i)])), connections)
        self._info: pb.InfoResponse | None = None

    def info(self) -> pb.InfoResponse:
        """The server's model and limits (asked once, then remembered)."""
        if self._info is None:
            try:
                # Fail fast (gRPC's default, with the retries of targets.py): an address nobody
                # listens on is UNAVAILABLE in about a second, not a silent wait of `timeout`.
                info = self._connections.next()[1].Info(pb.InfoRequest(), timeout=self.timeout,
                                                        metadata=self._metadata)
            except grpc.RpcError as exc:
                raise EmbedError.from_rpc(exc, self.target) from None
            self._connections.fit(info.frontends)
            self._info = info
        return self._info

    def embed(self, texts: str | Sequence[str], **options) -> Vectors:
        """Vectors for `texts`, one row each, in as many requests as the server's
        max_texts_per_request needs; `.model` names the served model that answered. Options as
        EmbedRequest's (pollen_client.build_request), `model` among them (empty: the server's
        first embedder)."""
        return concatenate([decode(reply, len(piece)) for piece, reply in self._replies(texts, options)])

    def embed_tokens(self, texts: str | Sequence[str], **options) -> Results:
        """Each text's token vectors (outputs OUTPUT_TOKENS): a float32 [tokens, dims] array per
        text, special tokens included, normalized unless normalize=False. Options as embed's."""
        replies = self._replies(texts, options, ("tokens",))
        return Results([rows for piece, reply in replies for rows in decode_tokens(reply, len(piece))],
                       replies[0][1].model)

    def embed_sparse(self, texts: str | Sequence[str], **options) -> Results:
        """Each text's sparse vector from a SPLADE model or BGE-M3 (outputs OUTPUT_SPARSE):
        (vocabulary ids, ascending, uint32; their weights, float32). sparse_top_k=K keeps each
        row's K largest; sparse_tokens=True adds each id's vocabulary string, a list third."""
        tokens = bool(options.get("sparse_tokens"))
        replies = self._replies(texts, options, ("sparse",))
        return Results([row for piece, reply in replies for row in decode_sparse(reply, len(piece), tokens)],
                       replies[0][1].model)

    def _replies(self, texts, options: dict, outputs: tuple = ("dense",)) -> list[tuple[list[str], pb.EmbedResponse]]:
        """(texts, Embed reply) per max_texts_per_request texts, in order."""
        replies = []
        for piece in split(texts, self.info().max_texts_per_request):
            try:
                replies.append((piece, self._connections.next()[1].Embed(
                    build_request(piece, outputs=outputs, **options), timeout=self.timeout, metadata=self._metadata)))
            except grpc.RpcError as exc:
                raise EmbedError.from_rpc(exc, self.target) from None
        return replies

    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None, *, model: str = "",
               **options) -> Results:
        """(index, score) of the documents against `query`, best first; `index` is the document's
        position in `documents`, `.model` the served reranker that answered (`model`; empty: the
        server's first reranker). Options as RerankRequest's (instruction, raw_scores, ...)."""
        request = pb.RerankRequest(query=query, documents=list(documents), top_n=top_n, model=model, **options)
        try:
            reply = self._connections.next()[1].Rerank(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise EmbedError.from_rpc(exc, self.target) from None
        return ranks(reply, len(request.documents), top_n)

    def classify(self, texts: str | Sequence[str], text_pairs: Sequence[str] | None = None, *, model: str = "",
                 **options) -> Results:
        """{label: score} of each text (or pair (texts[i], text_pairs[i])), in the texts' order,
        each best first; `.model` the served classifier that answered (`model`; empty: the
        server's first classifier). Options as ClassifyRequest's (raw_scores, max_tokens, ...)."""
        request = classify_request(texts, text_pairs, model=model, **options)
        try:
            reply = self._connections.next()[1].Classify(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise EmbedError.from_rpc(exc, self.target) from None
        return label_scores(reply, len(request.texts))

    def embed_stream(self, inputs: Iterable[str | Sequence[str]], *, in_flight: int = 16,
                     reconnect_within: float = 60.0, **options) -> Iterator[Vectors]:
        """Answers for `inputs` in input order: a vector for each string, a 2-D array for each list
        of texts (sent as one message), each with the `.model` that answered. Keeps `in_flight`
        messages on one EmbedStream; when the server is UNAVAILABLE (restarted, say, or one of the
        replicas gone) it reconnects and sends the unanswered ones again (on a replica that is up),
        giving up after `reconnect_within` seconds without a connection or without an answer
        (client/reconnect.py)."""
        order = StreamOrder(options, in_flight)
        source = iter(inputs)
        retries = Reconnects(self.target, reconnect_within)
        while not order.finished:
            # A connection first, within reconnect_within; then a call that fails at once if the
            # connection breaks (waiting for ready inside the call would wait without a bound).
            channel, stub = self._connections.next()
            self._wait_for_server(channel, reconnect_within)
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            call = stub.EmbedStream(_drain(outbox), metadata=self._metadata)
            try:
                for message in order.resend():
                    outbox.put(message)
                while not order.finished:
                    while order.room > 0:
                        item = next(source, _END)
                        if item is _END:
                            order.inputs_done = True
                        else:
                            outbox.put(order.add(item))
                    yield from order.ready()
                    if order.unanswered:
                        order.accept(next(call))
            except (grpc.RpcError, StopIteration) as exc:
                code = exc.code() if isinstance(exc, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise EmbedError.from_rpc(exc) from None
                time.sleep(retries.lost(order.answered, exc.details() if isinstance(exc, grpc.RpcError)
                                        else "the stream ended early"))
            finally:
                outbox.put(None)
                call.cancel()

    def _wait_for_server(self, channel: grpc.Channel, within: float) -> None:
        ready = grpc.channel_ready_future(channel)
        try:
            ready.result(timeout=within)
        except grpc.FutureTimeoutError:
            ready.cancel()  # else it stays subscribed to the channel's state
            raise EmbedError(grpc.StatusCode.UNAVAILABLE,
                             f"no connection to {self.target} within {within} s; stream abandoned") from None

    def close(self) -> None:
        for channel in self._connections.channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_END = object()


def _drain(outbox: queue.SimpleQueue):
    """The request side of a stream: messages until None."""
    while (message := outbox.get()) is not None:
        yield message
