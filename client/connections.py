"""A client's connections to a server: several gRPC channels, each call on the next.

A pollen server runs several frontend processes on one address (SO_REUSEPORT): the kernel hands
each new connection to one of them, and every call on that connection goes to that frontend. One
gRPC channel is one connection (per replica), so a client on one channel is served by one
frontend, about one core's worth of calls, however many the server runs. `Connections` opens
several channels, each with its own CONNECTION_ARG so that gRPC does not share one connection
between them, and gives each call the next in turn.

With `count` 0 (the clients' default) there is one until the server's Info says how many
frontends it runs (`fit`), then PER_FRONTEND for each, at most MAX_CONNECTIONS. The kernel picks a
connection's frontend by a hash, so as many connections as frontends leave about a third of the
frontends without one (11 connections reach about 7 of 11 frontends on average); twice as many
reach 9 to 10. A server with one frontend (pollen on a laptop) gets 2 connections.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from pollen.v1 import embedder_pb2_grpc as pb_grpc

CONNECTION_ARG = "pollen.client.connection"  # a channel argument gRPC only compares
PER_FRONTEND = 2
MAX_CONNECTIONS = 32
# Calls the client keeps in flight on one connection when it sends many at once: a frontend is
# kept busy by far fewer, and the server refuses a stream on a connection that nears its
# --grpc-max-streams-per-connection, which counts a stream until gRPC has torn it down.
IN_FLIGHT = 64


class Connections:
    """`make(i)` opens channel i (its options ending with (CONNECTION_ARG, i)); `count`: how many
    to keep, or 0 to follow the server's frontends once `fit` is told them."""

    def __init__(self, make: Callable[[int], object], count: int = 0):
        if count < 0 or count > MAX_CONNECTIONS:
            raise ValueError(f"connections must be 0 ({PER_FRONTEND} per frontend the server says it runs) to "
                             f"{MAX_CONNECTIONS}, got {count}")
        self.count = count
        self._make = make
        self._lock = threading.Lock()  # Client is used from many threads
        self._turn = itertools.count()  # next() of itertools.count is atomic under the GIL
        # (channel, stub) pairs in one list, so a reader never sees a channel without its stub.
        self.pairs: list[tuple[object, pb_grpc.EmbedderStub]] = []
        self._grow(max(1, count))

    def fit(self, frontends: int) -> None:
        """The server runs `frontends` frontend processes: open channels for them (count 0 only)."""
        if self.count == 0:
            self._grow(min(MAX_CONNECTIONS, PER_FRONTEND * max(1, frontends)))

    def next(self) -> tuple[object, pb_grpc.EmbedderStub]:
        """The channel and stub for the next call."""
        pairs = self.pairs
        return pairs[next(self._turn) % len(pairs)]

    @property
    def channels(self) -> list:
        return [channel for channel, _ in self.pairs]

    def _grow(self, n: int) -> None:
        with self._lock:
            while len(self.pairs) < n:
                channel = self._make(len(self.pairs))
                self.pairs.append((channel, pb_grpc.EmbedderStub(channel)))
