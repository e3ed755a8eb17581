"""When a lost EmbedStream is tried again, and when it is given up.

A stream that is lost after it made progress (an answer arrived since the last loss) is tried
again at once: a restarted server or a replica that went away. A stream lost again with no answer
between is tried after a pause that doubles from MIN_PAUSE_S to MAX_PAUSE_S, so a server that
ends every stream of ours (while it still takes connections) is not hammered; and once
`within` seconds have passed with no answer, the stream is given up with UNAVAILABLE. Waiting for
a connection is bounded by the same `within`, in the clients.
"""
from __future__ import annotations

import time

import grpc

from pollen.client.messages import EmbedError

MIN_PAUSE_S = 0.05
MAX_PAUSE_S = 1.0


class Reconnects:
    def __init__(self, target: str, within: float, clock=time.monotonic):
        self.target, self.within, self.clock = target, within, clock
        self.answered = 0
        self.since = clock()  # the last answer (or the start) before the losses now counted
        self.pause = 0.0

    def lost(self, answered: int, details: str) -> float:
        """The stream was lost with `answered` messages answered in all so far: the seconds to
        pause before trying again; EmbedError UNAVAILABLE when `within` has passed with no answer."""
        now = self.clock()
        if answered != self.answered:
            self.answered, self.since, self.pause = answered, now, 0.0
            return 0.0
        if now - self.since >= self.within:
            raise EmbedError(grpc.StatusCode.UNAVAILABLE,
                             f"no answer from {self.target} for {now - self.since:.1f} s while its streams "
                             f"kept ending (last: {details}); stream abandoned")
        self.pause = min(max(2 * self.pause, MIN_PAUSE_S), MAX_PAUSE_S)
        return self.pause
