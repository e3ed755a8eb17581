"""The frontend's request channel to one worker: send requests, read answers, resend after a death.

A `WorkerChannel` owns every request it routed to its worker until the answer arrives: the
request record (kept for a resend), the future its caller awaits, its place in the backlog. The
worker process itself belongs to the supervisor (server/process/supervisor.py), which hands the channel
the rings of each (re)started worker (`attach`) and takes them back when it dies (`detach`).

Flow: `send` puts a request in the backlog, one FIFO lane per priority, and `flush` moves the
backlog into the request ring while it has room (interactive first, so bulk never holds an
interactive request back here). The worker's answers arrive on the response ring's eventfd
(`read_answers`); each resolves its request's future. When the worker dies the channel reads the
answers it finished, then puts every unanswered request back into the backlog in its original
order, and another ready worker (or the next one here, once it says READY) gets them: the client
sees no error. A request the worker had read from the ring when it died, MAX_ATTEMPTS times in a
row, is answered INTERNAL instead, so one poisonous input cannot crash-loop a worker forever (a
request still in the ring, or in the backlog, was never held and does not count).

The channel publishes its queued tokens and backlog in the server state (shared_mem/server_state.py),
where admission and routing read them summed over every frontend.

Drops (docs/design/requests.md, "Deadlines and cancellation"): a request whose deadline passed or
whose client left is dropped before it reaches the model: here while it waits in the backlog, or
in the worker (the deadline travels in the record; a CANCEL record forgets a request not yet
batched), which answers it DEADLINE_EXCEEDED or CANCELLED. Each drop is counted once in
metrics.DROPPED: here for the backlog, on the worker's answer otherwise.

Everything here runs on the event loop's thread: answers arrive through loop.add_reader on the
response ring's eventfd, or, for a lone query, by polling (`spin`, --frontend-spin-us): the answer
is read the moment the worker commits it, without the eventfd's write and the scheduler's wake-up.
Under load nobody polls (other frontends have work in flight); the cost is bounded by the flag per
request sent, on about one core server-wide.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque

import grpc

from pollen.common import status
from pollen.common.errors import RequestError
from pollen.server.observe import metrics
from pollen.server.pipeline.request import Request
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring
from pollen.shared_mem.server_state import ServerState

log = logging.getLogger("pollen.channel")

MAX_ATTEMPTS = 3
IDLE_TICK = 0.05  # seconds between safety-net looks while nothing is outstanding

_DROP_REASONS = {records.DEADLINE_EXCEEDED: "deadline", records.CANCELLED: "cancelled"}


def dropped_error(reason: str) -> RequestError:
    if reason == "deadline":
        return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, status.DEADLINE_PASSED)
    return RequestError(grpc.StatusCode.CANCELLED, status.CANCELLED_BEFORE_MODEL)


class WorkerChannel:
    def __init__(self, index: int, frontend: int, state: ServerState, spin_us: int = 0):
        self.index = index
        self.frontend = frontend
        self.state = state
        self.model_names: list[str] = []  # the served models' names, in --model's order (the frontend sets them)
        self.loop = asyncio.get_running_loop()
        self.inflight: dict[int, Request] = {}
        # Request ids admitted but not yet in the ring, one FIFO lane per priority.
        self.backlog: tuple[deque[int], deque[int]] = (deque(), deque())
        self.queued_tokens = 0
        self.requests: Ring | None = None
        self.responses: Ring | None = None
        self.ready = asyncio.Event()
        self.generation = 0  # bumped at each attach, so the ticks of a dead worker's rings stop
        self.on_ready_change = lambda: None  # the frontend's health follows its workers
        # After a death, the router hands the survivors to another ready worker (server/pipeline/router.py);
        # by default (and when no other worker is ready) they wait here for the restart.
        self.on_orphans = self.adopt
        self.spin_ns = spin_us * 1000
        self.spinning = False  # polling the response ring on each loop turn (see `spin`)
        self.spin_until = 0

    # ---- the worker's rings ----

    def attach(self, requests: Ring, responses: Ring) -> None:
        """Use the rings of a newly started worker; requests flow once it says READY."""
        self.requests, self.responses = requests, responses
        self.loop.add_reader(responses.data_fd, self.read_answers)
        self.loop.add_reader(requests.space_fd, self.flush)
        self.generation += 1
        self.spinning = False  # a spin on the last rings stops at its next look
        self.loop.call_later(requests.wait_slice, self.tick, self.generation)
        if responses.sleep_unless_data():
            self.read_answers()  # a worker ready before we armed: its READY wrote no eventfd

    def detach(self, requeue: bool) -> None:
        """The worker is gone (or stopping): read what it answered, stop using its rings and,
        with `requeue`, hand every unanswered request on (`requeue`)."""
        if self.responses is None:
            return
        self.ready.clear()
        self.on_ready_change()
        self.read_answers()  # answers the worker finished before it went still count
        read_to = self.requests.read_pos  # how far the worker had read our requests
        self.loop.remove_reader(self.responses.data_fd)
        self.loop.remove_reader(self.requests.space_fd)
        self.requests.close()
        self.responses.close()
        self.requests = self.responses = None
        if requeue:
            self.requeue(read_to)

    def requeue(self, read_to: int) -> None:
        """After a death: every unanswered request goes again, in the order it was first
        admitted, except those whose client left and those that reached MAX_ATTEMPTS."""
        for req_id, request in list(self.inflight.items()):
            if request.drop_reason:  # its client left: nobody wants it any more
                self.drop(req_id, request.drop_reason)
                continue
            if request.sent and request.ring_end <= read_to:
                request.attempts += 1  # the worker had it: it may be what killed the worker
            request.sent = False
            if request.attempts >= MAX_ATTEMPTS:
                self.fail(req_id, RequestError(grpc.StatusCode.INTERNAL,
                                               f"the worker died {request.attempts} times while holding this request"))
        survivors = [self.inflight.pop(req_id) for req_id in sorted(self.inflight)]
        self.backlog = (deque(), deque())
        self.queued_tokens = 0
        self.on_orphans(survivors)
        self.publish()

    def adopt(self, survivors: list[Request]) -> None:
        """Take over unanswered requests of a dead worker (this one's or another's), in order."""
        for request in survivors:
            request.sent = False
            self.inflight[request.req_id] = request
            self.queued_tokens += request.tokens
            self.backlog[request.options.lane].append(request.req_id)
        self.flush()

    def publish(self) -> None:
        """Store this channel's queued tokens and backlog in the server state."""
        self.state.publish(self.frontend, self.index, self.queued_tokens, len(self.backlog[0]) + len(self.backlog[1]))

    def tick(self, generation: int) -> None:
        """The safety net for a lost wake-up (see shared_mem/ring.py): look again every few ms
        while work is outstanding. Nothing to do when idle, so an idle server stays quiet."""
        if generation != self.generation or self.responses is None:
            return  # these rings are gone; the next worker's run their own tick
        if self.responses.has_data():  # a lost wake-up: a READY record, or answers (no system call)
            self.read_answers()
        if self.inflight:
            self.read_answers()
            self.expire_backlog()
            self.flush()
            # The worker's wake-up can be lost the same way; it sleeps in long slices and
            # relies on this nudge while it holds unread requests.
            if self.requests.free_bytes() < self.requests.capacity:
                self.requests.notify_consumer()
        self.loop.call_later(self.requests.wait_slice if self.inflight else IDLE_TICK, self.tick, generation)

    # ---- requests ----

    def send(self, request: Request) -> asyncio.Future:
        """Send an encoded request (its record made, its req_id set); the future of its answer."""
        request.future = future = self.loop.create_future()
        self.inflight[request.req_id] = request
        self.queued_tokens += request.tokens
        if request.options.expired(time.monotonic_ns()):
            self.drop(request.req_id, "deadline")
            return future
        self.backlog[request.options.lane].append(request.req_id)
        self.flush()
        if self.spin_ns:
            self.start_spin()
        return future

    def start_spin(self) -> None:
        """Poll the response ring for the next spin_ns if this frontend is the only one with work
        in flight: the client's next call, if it comes within that time, finds the loop awake and
        its core warm."""
        ring = self.responses
        if ring is None or self.state.queued_total() != self.state.queued_by(self.frontend):
            return
        self.spin_until = time.monotonic_ns() + self.spin_ns
        if not self.spinning:
            self.spinning = True
            ring.set_consumer_sleeping(False)  # the worker skips the eventfd while we poll
            self.loop.call_soon(self.spin, self.generation)

    def spin(self, generation: int) -> None:
        """One look at the response ring; again on the loop's next turn while the spin lasts.
        Other callbacks and I/O run between two looks."""
        ring = self.responses
        if generation != self.generation or ring is None:
            return  # these rings are gone; attach() starts afresh
        if ring.has_data():
            self.read_answers()
        # On after the answer too, until spin_until: a client that sends its next query within
        # that time finds this loop awake (gRPC's poller thread hands the call over at once) and
        # its core warm, as the worker's own spin does for the rings.
        if time.monotonic_ns() < self.spin_until:
            self.loop.call_soon(self.spin, generation)
            return
        self.spinning = False
        if ring.sleep_unless_data():  # back to the eventfd
            self.read_answers()

    def cancel(self, req_id: int, reason: str) -> None:
        """The client left (or its deadline passed): drop the request if it has not reached the model."""
        request = self.inflight.get(req_id)
        if request is None or request.drop_reason:
            return
        if not request.sent:
            self.backlog[request.options.lane].remove(req_id)
            self.drop(req_id, reason)
            return
        # In the ring or the worker: the worker answers CANCELLED if it had not batched it yet,
        # else the answer comes as usual and is thrown away (the future is already done).
        request.drop_reason = reason
        if self.requests is not None:
            self.requests.try_write(records.CANCEL, records.encode_cancel(req_id))

    def drop(self, req_id: int, reason: str) -> None:
        metrics.DROPPED.labels(reason=reason).inc()
        self.fail(req_id, dropped_error(reason))

    def expire_backlog(self) -> None:
        """Drop backlogged requests whose deadline passed (the ring may be full for a while)."""
        now = time.monotonic_ns()
        for lane in self.backlog:
            expired = [r for r in lane if r in self.inflight and self.inflight[r].options.expired(now)]
            for req_id in expired:
                lane.remove(req_id)
                self.drop(req_id, "deadline")
        self.publish()

    def flush(self) -> None:
        """Move backlogged requests into the ring while it has room: interactive ones first,
        FIFO within a lane; one whose deadline passed is dropped instead. Publishes this
        channel's figures in every case (callers change them just before)."""
        ring = self.requests
        if ring is None or not self.ready.is_set():
            self.publish()
            return
        if ring.producer_sleeping:  # we asked the worker for a signal when room frees up
            Ring.drain_signal(ring.space_fd)
        for first_try in (True, False):
            self.flush_lanes(ring)
            if not any(self.backlog):
                ring.set_producer_sleeping(False)
                self.publish()
                return
            if first_try:
                # Ask the worker to signal space_fd when it frees room, then try once more: it
                # may have freed some before it saw the flag.
                ring.set_producer_sleeping(True)
        self.publish()

    def flush_lanes(self, ring: Ring) -> None:
        now = time.monotonic_ns()
        for lane in self.backlog:
            while lane:
                request = self.inflight.get(lane[0])
                if request is not None:
                    if request.options.expired(now):
                        self.drop(lane.popleft(), "deadline")
                        continue
                    if not ring.try_write(records.REQUEST, request.record):
                        return  # the ring is full; bulk must not pass interactive work
                    request.sent = True
                    request.ring_end = ring.write_pos
                lane.popleft()

    # ---- answers ----

    def read_answers(self) -> None:
        ring = self.responses
        Ring.drain_signal(ring.data_fd)
        while True:
            ring.set_consumer_sleeping(False)
            with ring.reading() as answers:
                for kind, view in answers:
                    if kind == records.RESULT:
                        self.answer(records.decode_result(view))
                    elif kind == records.BATCH_RESULT:
                        report, results = records.decode_batch_result(view)  # bodies copied out
                        self.on_batch(report)
                        for result in results:
                            self.answer(result)
                    elif kind == records.READY:
                        self.on_ready(json.loads(bytes(view)))
            if self.spinning:  # `spin` looks again on the next turn, and sets the flag when it stops
                return
            if not ring.sleep_unless_data():
                return

    def on_ready(self, info: dict) -> None:
        self.ready.set()
        for i, model in enumerate(info.get("models", ())):  # in --model's order; named as this server serves them
            name = self.model_names[i] if i < len(self.model_names) else model["name"]
            metrics.MODEL_MEMORY.labels(name, str(self.index)).set(model["memory_bytes"])
        log.info("worker %d ready: %s", self.index, info)
        self.on_ready_change()
        self.flush()

    def on_batch(self, report: records.BatchReport) -> None:
        if report.batch_tokens:  # the batch's first part: count the batch once
            metrics.DEFERRED.observe(metrics.BATCH_TOKENS, report.batch_tokens)
        metrics.DEFERRED.inc(metrics.SEQUENCES, report.seqs)

    def answer(self, result: records.ResultRecord) -> None:
        request = self.inflight.pop(result.req_id, None)
        if request is None:
            return
        self.queued_tokens -= request.tokens
        self.publish()
        reason = _DROP_REASONS.get(result.status)
        if reason:  # the worker dropped it before the model; count it once, here
            metrics.DROPPED.labels(reason=request.drop_reason or reason).inc()
        elif result.status == records.OK:
            metrics.DEFERRED.observe(metrics.QUEUE_SECONDS, result.queue_us / 1e6)
            metrics.DEFERRED.observe(metrics.INFERENCE_SECONDS, result.inference_us / 1e6)
        if not request.future.done():
            request.future.set_result(result)

    def fail(self, req_id: int, error: Exception) -> None:
        request = self.inflight.pop(req_id)
        self.queued_tokens -= request.tokens
        self.publish()
        if not request.future.done():
            request.future.set_exception(error)
