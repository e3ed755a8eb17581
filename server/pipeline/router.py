"""Admitted requests to workers: the queued-token limit and the least-loaded worker.

The router encodes an admitted request as its request record (shared_mem/records.py), in parts
when it is too big for one (server/pipeline/request.py), sends it through the channel of the ready worker
with the fewest queued tokens (server/pipeline/channel.py), and awaits the answer. `--max-queued-tokens`
bounds the tokens admitted and not yet answered, over all workers and all frontends (the server
state sums them: shared_mem/server_state.py); past it a request is refused RESOURCE_EXHAUSTED with
the figures.
"""
from __future__ import annotations

import asyncio
import itertools
import time

import grpc

from pollen.common import status
from pollen.common.errors import RequestError
from pollen.server.config import ServeConfig
from pollen.server.pipeline.channel import WorkerChannel
from pollen.server.pipeline.request import Request, join
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring
from pollen.shared_mem.server_state import ServerState

# gRPC core's deadline timer can fire a little before our copy of the deadline (taken from
# time_remaining() when the handler started): a client that leaves this close to its deadline
# counts as the deadline's drop.
DEADLINE_SLACK_NS = 50_000_000


class Router:
    def __init__(self, cfg: ServeConfig, channels: list[WorkerChannel], state: ServerState):
        self.cfg = cfg
        self.channels = channels
        self.state = state
        self.ids = itertools.count(1)
        self.max_record = Ring.max_record_for(cfg.request_ring_bytes)
        for channel in channels:
            channel.on_orphans = lambda survivors, dead=channel: self.rehome(dead, survivors)

    def rehome(self, dead: WorkerChannel, survivors: list[Request]) -> None:
        """A worker died: its unanswered requests go to the least-loaded other ready worker
        rather than wait for its restart (model load and warm-up take seconds)."""
        others = [c for c in self.channels if c is not dead and c.ready.is_set()]
        target = min(others, key=lambda c: self.state.queued_on(c.index)) if others else dead
        target.adopt(survivors)

    @property
    def queued_tokens(self) -> int:
        """Tokens admitted and not yet answered, over the whole server."""
        return self.state.queued_total()

    async def answer(self, request: Request) -> records.ResultRecord:
        """route(), a worker's refusal (its status) raised as the RequestError it stands for."""
        result = await self.route(request)
        if result.status:
            raise RequestError(status.code_of(result.status, grpc.StatusCode.INTERNAL),
                               result.body.decode(errors="replace"))
        return result

    async def route(self, request: Request) -> records.ResultRecord:
        """The worker's answer to an admitted request (its parts' answers joined)."""
        queued = self.queued_tokens
        if queued + request.tokens > self.cfg.max_queued_tokens:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the server holds {queued} queued tokens and this request adds "
                               f"{request.tokens}, over --max-queued-tokens {self.cfg.max_queued_tokens}; retry later")
        now = time.monotonic_ns()
        request.req_id = next(self.ids)
        request.record = records.encode_request(request.req_id, now, request.seqs, request.options, request.rows)
        # A record holds at most --max-texts-per-request outputs (the response ring is sized for
        # one batch of them: server/process/app.py); the OpenAI route's longer lists travel as parts too.
        max_rows = self.cfg.max_texts_per_request
        if len(request.record) <= self.max_record and request.outputs() <= max_rows:
            return await self.send(request)
        try:
            parts = request.parts(self.max_record, max_rows)
        except ValueError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; split it") from None
        for part in parts:
            part.req_id = next(self.ids)
            part.record = records.encode_request(part.req_id, now, part.seqs, part.options, part.rows)
        results = await asyncio.gather(*(self.send(part) for part in parts))
        failed = next((r for r in results if r.status != records.OK), None)
        return failed or join(results)

    async def send(self, request: Request) -> records.ResultRecord:
        """One request record to the ready worker with the fewest queued tokens; its answer."""
        channel = self.channels[0] if len(self.channels) == 1 else min(
            self.channels, key=lambda c: (not c.ready.is_set(), self.state.queued_on(c.index)))
        try:
            return await channel.send(request)
        except asyncio.CancelledError:
            # The client left (a unary call cancelled or past its gRPC deadline, a stream closed).
            deadline_ns = request.options.deadline_ns
            late = deadline_ns and time.monotonic_ns() >= deadline_ns - DEADLINE_SLACK_NS
            # A worker's death may have moved it to another channel (rehome).
            holder = next((c for c in self.channels if request.req_id in c.inflight), channel)
            holder.cancel(request.req_id, "deadline" if late else "cancelled")
            raise
