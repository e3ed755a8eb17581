"""The bookkeeping of one embed_stream, shared by the blocking and the asyncio client.

Messages get ids 0, 1, 2, ... in input order. `unanswered` keeps every message sent and not yet
answered, in order, so that after a reconnect exactly those are sent again; an answer whose id is
no longer unanswered (one that crossed a reconnect) is ignored, so each input is answered once.
Answers that arrive early wait in `early` until every earlier one has been yielded; the window
(`in_flight`) bounds unanswered and early together, so memory stays bounded when one message is slow.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pollen.client.messages import build_request, decode
from pollen.v1 import embedder_pb2 as pb


class StreamOrder:
    def __init__(self, options: dict, in_flight: int):
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        self.options = options
        self.window = in_flight
        self.unanswered: dict[int, tuple[pb.EmbedRequest, bool]] = {}  # id -> (message, single text)
        self.early: dict[int, np.ndarray] = {}
        self.next_id = 0
        self.next_out = 0
        self.inputs_done = False

    @property
    def room(self) -> int:
        return 0 if self.inputs_done else self.window - len(self.unanswered) - len(self.early)

    @property
    def answered(self) -> int:
        """Messages answered so far (yielded or waiting for an earlier one)."""
        return self.next_out + len(self.early)

    @property
    def finished(self) -> bool:
        return self.inputs_done and not self.unanswered and not self.early

    def add(self, item) -> pb.EmbedRequest:
        """One input (a text, or a list of texts sent as one message) as the next message."""
        message = build_request(item, request_id=str(self.next_id), **self.options)
        self.unanswered[self.next_id] = (message, isinstance(item, str))
        self.next_id += 1
        return message

    def accept(self, response: pb.EmbedResponse) -> None:
        """Take one answer; raises EmbedError when the server failed that message."""
        key = int(response.id) if response.id.isdigit() else -1
        entry = self.unanswered.pop(key, None)
        if entry is None:
            return  # answered already (before a reconnect): never twice
        message, single = entry
        rows = decode(response, len(message.texts))
        self.early[key] = rows[0] if single else rows

    def ready(self) -> Iterator[np.ndarray]:
        """The answers that can be yielded now, in input order."""
        while self.next_out in self.early:
            yield self.early.pop(self.next_out)
            self.next_out += 1

    def resend(self) -> list[pb.EmbedRequest]:
        return [message for message, _ in self.unanswered.values()]
