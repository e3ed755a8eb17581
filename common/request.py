"""What a request asks of the model, in the form both sides of the rings read: its task, its lane
and its options (shared_mem/records.py carries them in the request record's header)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from enum import IntEnum

from pollen.v1 import embedder_pb2 as pb


class Task(IntEnum):
    """What the worker computes for a request. Every task travels the same path: admission, the
    request record, token-budget batches, the answer record."""

    EMBED = 0  # pooled vectors, one per output
    SCORE = 1  # a head's outputs (a reranker's logit, a classifier's), one row per sequence


class Lane(IntEnum):
    """The batcher's and the engine's queues (docs/design/requests.md, "Priority lanes"); the numbers
    are the protobuf Priority values."""

    INTERACTIVE = pb.PRIORITY_INTERACTIVE
    BULK = pb.PRIORITY_BULK


LANES = tuple(Lane)  # indexed by a Priority number: Lane(n) without the enum's lookup
# The enums' lower-case names (the HTTP door's JSON, --default-truncate, the bulk embedder) to proto values.
TRUNCATE_BY_NAME = {"none": pb.TRUNCATE_NONE, "end": pb.TRUNCATE_END, "start": pb.TRUNCATE_START}
PRIORITY_BY_NAME = {"interactive": pb.PRIORITY_INTERACTIVE, "bulk": pb.PRIORITY_BULK}
LONG_INPUT_BY_NAME = {"truncate": pb.LONG_INPUT_TRUNCATE, "chunk_mean": pb.LONG_INPUT_CHUNK_MEAN}


def lane_of(priority: int) -> Lane:
    """A request's lane from its priority field; INVALID_ARGUMENT, naming it, for a number the
    proto does not define (every request type's check: embed, rerank and classify alike)."""
    if not 0 <= priority < len(LANES):
        from pollen.common.errors import invalid

        raise invalid(f"priority {priority} is not a known Priority value")
    return LANES[priority]


@dataclass(slots=True)
class RequestOptions:
    """How the worker answers one request; resolved by the frontend's admission, read by the worker."""

    task: Task = Task.EMBED
    dims: int = 0                 # 0: the model's full size
    normalize: bool = False
    encoding: int = pb.ENCODING_FLOAT32
    lane: Lane = Lane.INTERACTIVE
    deadline_ns: int = 0          # CLOCK_MONOTONIC ns by which it must reach the model; 0: none
    model: int = 0                # which of the server's models answers it (its index in --model's list)

    @staticmethod
    def deadline(deadline_ns: int, timeout_ms: int) -> int:
        """The earlier of `deadline_ns` (0: none) and a request's own timeout_ms from now (0: none)."""
        if not timeout_ms:
            return deadline_ns
        own = time.monotonic_ns() + timeout_ms * 1_000_000
        return min(deadline_ns, own) if deadline_ns else own

    def expired(self, now_ns: int) -> bool:
        """The deadline passed: the request is dropped wherever it waits (never once batched)."""
        return 0 < self.deadline_ns <= now_ns
