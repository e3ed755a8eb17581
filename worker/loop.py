"""The worker's loop: drain every frontend's request ring, batch by tokens, run the model, answer.

Each frontend process has a link to the worker (worker/links.py): a request ring in and a
response ring out. The batcher mixes the requests of all links; a batch is answered by one
BATCH_RESULT record per link it holds requests of (its *share*, shared_mem/records.py), whose
space is held in that link's response ring when the batch is launched: the engine writes each
share's pooled rows straight into it, and the worker commits it once the batch is done. Batch N+1
is launched before N is awaited, so two records can be open per ring; they are committed in
launch order. The worker never waits for ring space while it holds a record open (the frontend
cannot read past it): when only a commit could make room, it finishes its open batches first
(`Worker.room`).

A worker holds every model the server serves, each in a slot of its own (worker/model_slot.py:
engine, batcher, batches in flight); a request goes to the slot its record names. Each model's
lanes keep their own batches in flight (on CUDA up to two per lane and model, on the model's own
streams), so a busy model never holds another's batch behind its own: the GPU runs them side by
side, the interactive streams at the higher priority. An engine that runs one batch at a time
(the CPU) takes turns between the models with work, those with interactive work first. With
several models on CUDA no batch holds its records at launch: a record held for one model's long
batch would hold back, unpublished, every answer behind it in the ring (records publish in the
order taken), the other model's queries too; each batch takes its records when it is done.

The supervisor drives the links over the control link (common/control.py): add_link, drop_link
(a frontend died: its requests are dropped), stop (finish what is held, then exit). The loop
stores a heartbeat in the server state at every turn (shared_mem/server_state.py), so a worker
that stops making progress is found and restarted.
"""
from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from pollen.common import control, status
from pollen.common.request import LANES, Lane
from pollen.common.worker_config import WorkerConfig
from pollen.shared_mem import records
from pollen.shared_mem.ring import CommitFirst, Reservation, Ring
from pollen.shared_mem.server_state import ServerState
from pollen.worker.batch_answer import BatchAnswer
from pollen.worker.batcher import Batcher, Job
from pollen.worker.engine import PendingRows
from pollen.worker.links import Link, wait_for_work
from pollen.worker.model_slot import ModelSlot
from pollen.worker.packed import RowSpans, pack

INTERACTIVE, BULK = LANES  # Lane's members, bound once: each Lane.X costs an enum lookup per turn
CONTROL_EVERY_NS = 5_000_000  # how often a busy loop looks at the control link
# With several models on one GPU, an interactive request of more tokens than this (a rerank of
# 100 documents) is batched in its model's bulk lane: its batches then run on the low-priority
# stream and SM partition, so another model's queries never wait behind them
# (docs/design/requests.md, "Several models").
SHARED_GPU_INTERACTIVE_TOKENS = 4096


def run_lane(lane: Lane, tokens: int, large: int) -> Lane:
    """The lane a request of `tokens` is batched in: its own, or BULK for an interactive one over
    `large` tokens (0: none is large)."""
    return BULK if lane == INTERACTIVE and large and tokens > large else lane


@dataclass(slots=True)
class LinkShare:
    """One link's share of a batch: its answer plan and the record held for it (None until the
    batch is done, for a bulk batch on an engine that runs the lanes side by side)."""

    link: Link
    plan: BatchAnswer
    record: Reservation | None


@dataclass(slots=True)
class InFlight:
    """A submitted batch: its model, its lane, its links' shares, the engine's pending result (or
    the error the engine's submit raised), and its place in launch order."""

    slot: ModelSlot
    lane: Lane
    shares: list[LinkShare]
    pending: PendingRows | None
    error: Exception | None
    start_ns: int
    seq: int

    @property
    def done(self) -> bool:
        """True when the result is there already (the CPU engine computes in submit)."""
        return self.error is not None or self.pending.done()


class Worker:
    def __init__(self, cfg: WorkerConfig, slots: list[ModelSlot]):
        self.cfg = cfg
        self.slots = slots
        models = [{"name": slot.spec.name, "task": slot.spec.task, "memory_bytes": slot.memory} for slot in slots]
        self.ready_info = json.dumps({"pid": os.getpid(), "index": cfg.index, "device": cfg.device, "gpu": cfg.gpu,
                                      "dtype": cfg.dtype, "threads": cfg.threads, "model": slots[0].spec.name,
                                      "models": models, "bulk_sms": slots[0].engine.bulk_sms}).encode()
        self.control = socket.socket(fileno=cfg.control_fd)
        self.control.setblocking(False)
        self.control_queue: deque[tuple[dict, list[int]]] = deque()  # read, not yet acted on
        self.state = ServerState.attach(cfg.state)
        self.links: dict[int, Link] = {}
        # Rows per batch are capped so that a share's record always fits its ring. Sizing the ring
        # for the token budget instead would mean 2 x max_batch_tokens x hidden x 4 bytes (pinned,
        # on a GPU) for batches of one-token texts that real traffic never sends.
        for slot in slots:
            max_rows = records.max_batch_rows(Ring.max_record_for(cfg.response_ring_bytes), slot.hidden)
            slot.batcher = Batcher(cfg.max_batch_tokens, cfg.bulk_batch_tokens, max_rows)
        # On an engine that runs the lanes side by side (CUDA) each lane of each model keeps up to
        # two batches in flight; otherwise one batch is in flight at a time.
        self.side_by_side = slots[0].engine.side_by_side
        # Records held at launch (module docstring): on one model's CUDA engine for interactive
        # batches; on the CPU always (its batches are done once submitted).
        self.hold_records = not self.side_by_side or len(slots) == 1
        self.large_interactive = SHARED_GPU_INTERACTIVE_TOKENS if self.side_by_side and len(slots) > 1 else 0
        self.turn = 0  # the model whose turn it is on an engine that runs one batch at a time
        self.batches = 0
        self.stopping = False

    def queued(self) -> bool:
        """A request waits in some model's batcher."""
        return any(slot.batcher for slot in self.slots)

    def in_flight(self) -> bool:
        return any(slot.busy() for slot in self.slots)

    # ---- the loop ----

    def run(self) -> None:
        """The loop. Each turn adds the time of its phases to the server state (PHASES)."""
        self.state.set_ready(self.cfg.index, True)
        phase = self.state.phase_view(self.cfg.index)  # requests, launch, answer, wait (ns)
        counts = self.state.counts_view(self.cfg.index)
        counts[:] = 0
        for slot in self.slots:  # every engine adds its graph counts to the worker's
            slot.engine.keep_counts_in(counts)
        now = time.monotonic_ns
        control_at = 0
        while True:
            t0 = now()
            self.state.beat(self.cfg.index, self.batches)
            if t0 >= control_at:  # the control link, every few ms: messages are rare
                self.handle_control()
                control_at = t0 + CONTROL_EVERY_NS
            self.drain_requests()
            self.drop_expired()
            t1 = now()
            # Launch before collecting: batch N+1 is packed and launched while N still runs.
            launched = self.launch(t1)
            t2 = now()
            answered = self.collect()
            t3 = now()
            phase[0] += t1 - t0
            phase[1] += t2 - t1
            phase[2] += t3 - t2
            if launched or answered:
                continue
            if self.stopping and not (self.in_flight() or self.queued()):
                return
            self.idle()
            phase[3] += now() - t3

    def idle(self) -> None:
        """Nothing to launch or answer this turn: wait for a running batch, or spin, then sleep,
        for new requests."""
        if self.in_flight():
            self.await_progress()
            return
        if self.spin_for_requests():
            return
        wait_for_work(list(self.links.values()), self.control.fileno(), timeout=1.0)
        self.handle_control()
        if os.getppid() != self.cfg.parent_pid:
            raise SystemExit(0)  # the server is gone; nobody will read our answers

    def launch(self, now_ns: int) -> bool:
        """Submit what the lanes take: side by side, each model's lanes up to two batches in flight
        (none of a model's interactive lane's while its engine holds them: its own work, such as
        graph captures, worker/cuda_engine.py); otherwise one mixed batch at a time, of the next
        model with work in turn, those with interactive work first."""
        if not self.side_by_side:
            if self.in_flight() or not self.queued():
                return False
            slot = self.next_turn()
            self.launch_batch(slot, slot.batcher.next_batch(), INTERACTIVE)
            return True
        launched = False
        # An engine's own work (graph captures) waits for every model's interactive work, not only
        # its own: a capture holds the worker's one thread, and with it every model's launches.
        waiting = any(slot.batcher.lanes[INTERACTIVE] for slot in self.slots)
        running = any(slot.open[INTERACTIVE] for slot in self.slots)
        for slot in self.slots:
            batcher, open_ = slot.batcher, slot.open
            hold = slot.engine.between_batches(waiting, running, now_ns)
            for lane in LANES:
                if hold and lane == INTERACTIVE:
                    continue  # its batches in flight finish first, then the engine's work
                if batcher.lanes[lane] and len(open_[lane]) < 2:
                    self.launch_batch(slot, batcher.next_batch(lane), lane)
                    launched = True
        return launched

    def next_turn(self) -> ModelSlot:
        """The model whose mixed batch goes next: after the last one served, the first with
        interactive work, else the first with any (round robin: a busy model never starves another)."""
        n = len(self.slots)
        order = [self.slots[(self.turn + i) % n] for i in range(n)]
        slot = next((s for s in order if s.batcher.lanes[INTERACTIVE]), None) or next(s for s in order if s.batcher)
        self.turn = (slot.index + 1) % n
        return slot

    def collect(self) -> bool:
        """Answer the batches that are done, in launch order within each model's lane."""
        answered = False
        for slot in self.slots:
            for queue in slot.open:
                while queue and queue[0].done:
                    self.answer(queue.popleft())
                    answered = True
        return answered

    def await_progress(self) -> None:
        """Batches run and none is done: poll for a finished batch, a new request or a control
        message for a moment (the worker owns its cores; a blocking wait would hold up an
        interactive request that arrives meanwhile behind a bulk batch)."""
        deadline = time.monotonic_ns() + 2_000_000
        oldest = [queue[0] for slot in self.slots for queue in slot.open if queue]
        checks = [link.requests.has_data for link in self.links.values()]
        now = time.monotonic_ns
        while now() < deadline:
            if any(batch.done for batch in oldest) or any(has_data() for has_data in checks):
                return

    def spin_for_requests(self) -> bool:
        """Poll the request rings for cfg.spin_us; True as soon as something arrived. A sleeping
        worker costs each query an eventfd write and a scheduler wake-up; a spinning one sees the
        request the moment it is committed (the frontend does not even write the eventfd then)."""
        if self.cfg.spin_us <= 0:
            return False
        deadline = time.monotonic_ns() + self.cfg.spin_us * 1000
        checks = [link.requests.has_data for link in self.links.values()]
        now = time.monotonic_ns
        while now() < deadline:
            for has_data in checks:
                if has_data():
                    return True
        return False

    # ---- the control link ----

    def poll_control(self) -> None:
        """Read the control link's messages without acting on them, except to mark a dropped
        link gone at once: its ring then takes answers nobody reads (see `room`). A closed link
        means the supervisor is gone: a killed one closes its sockets a moment before the kernel's
        SIGKILL reaches us (die_with_parent), and in that moment we stop as the parent-pid checks
        do, without a traceback."""
        while True:
            try:
                message = control.receive(self.control)
            except EOFError:
                raise SystemExit(0) from None
            if message is None:
                return
            self.control_queue.append(message)
            body = message[0]
            if body["kind"] == "drop_link" and body["frontend"] in self.links:
                self.links[body["frontend"]].gone = True

    def handle_control(self) -> None:
        self.poll_control()
        while self.control_queue:
            body, fds = self.control_queue.popleft()
            kind = body["kind"]
            if kind == "add_link":
                self.add_link(Link(body["frontend"], body["requests"], body["responses"], fds))
            elif kind == "drop_link":
                self.drop_link(body["frontend"])
            elif kind == "stop":
                self.stopping = True

    def add_link(self, link: Link) -> None:
        # The device copies each share's rows straight into its response ring's memory. Page-locking
        # is the process's, not an engine's: the first model's engine does it for every model.
        self.slots[0].engine.register_host_memory(*link.responses.mapped_memory())
        self.links[link.frontend] = link
        link.responses.write(records.READY, self.ready_info)

    def drop_link(self, frontend: int) -> None:
        """Its frontend is gone: finish the open batches (they may write into its ring), forget
        its requests, let go of its rings."""
        link = self.links.pop(frontend, None)
        if link is None:
            return
        self.links[frontend] = link  # the open batches still answer on it
        for slot in self.slots:
            for queue in slot.open:
                while queue:
                    self.answer(queue.popleft())
        del self.links[frontend]
        for slot in self.slots:
            slot.batcher.drop_source(frontend)
        self.slots[0].engine.unregister_host_memory(link.responses.mapped_memory()[0])
        link.close()

    # ---- requests ----

    def drain_requests(self) -> None:
        for link in self.links.values():
            with link.requests.reading() as requests:
                for kind, view in requests:
                    if kind == records.REQUEST:
                        self.add(Job.of(records.decode_request(view), link.frontend))
                    elif kind == records.CANCEL:
                        self.cancel(records.decode_cancel(view), link.frontend)

    def cancel(self, req_id: int, frontend: int) -> None:
        """A CANCEL record: the request is answered CANCELLED if no batch holds it yet."""
        for slot in self.slots:
            job = slot.batcher.cancel(req_id, frontend)
            if job is not None:
                self.write_error(job, status.CANCELLED_BEFORE_MODEL, records.CANCELLED)
                return

    def add(self, job: Job) -> None:
        """A request into its model's batcher (a model this worker does not hold: the frontend's bug, answered)."""
        model = job.rec.options.model
        if model < len(self.slots):
            self.slots[model].batcher.add(job, run_lane(job.rec.options.lane, job.tokens(0, job.n_seqs),
                                                        self.large_interactive))
        else:
            self.write_error(job, f"the request names model {model}; this worker holds {len(self.slots)}. "
                                  "This is a bug.")

    def drop_expired(self) -> None:
        """Answer DEADLINE_EXCEEDED for requests whose deadline passed before they were batched."""
        now_ns = time.monotonic_ns()
        dropped = [job for slot in self.slots for job in slot.batcher.expire(now_ns)]
        for job in dropped:
            self.write_error(job, status.DEADLINE_PASSED, records.DEADLINE_EXCEEDED)
        for source in {job.source for job in dropped}:
            self.links[source].responses.notify_consumer()

    # ---- batches ----

    def launch_batch(self, slot: ModelSlot, spans: list[tuple[Job, int, int]], lane: Lane) -> InFlight:
        """Plan each link's share of the batch and launch it on the model's engine. Its records are
        held now and the engine copies the rows straight into them, except for a bulk batch beside
        interactive ones, and any batch of a CUDA worker with several models (module docstring):
        its records are taken when it is done (a held record would hold back the records behind it
        in the ring: records publish in the order taken)."""
        start_ns = time.monotonic_ns()
        spans = sorted(spans, key=lambda span: span[0].source)  # each link's rows together
        shares = []
        for source, group in itertools.groupby(spans, key=lambda span: span[0].source):
            batch_tokens = sum(job.tokens(a, b) for job, a, b in spans) if not shares else 0
            plan = BatchAnswer(list(group), slot.hidden, slot.spec.native_int8, batch_tokens)
            shares.append(LinkShare(self.links[source], plan, None))
        held = self.hold_records and (lane == INTERACTIVE or not self.side_by_side)
        for share in shares if held else ():
            share.record = self.reserve(share.link, share.plan)
        sequences = [job.rec.ids[job.offsets[i]:job.offsets[i + 1]] for job, a, b in spans for i in range(a, b)]
        # Rows differ from sequences only for contextual chunks, CHUNK_MEAN windows and token vectors.
        plain = all(job.rec.rows is None for job, _, _ in spans)
        rows = None if plain else RowSpans.concat([job.row_spans(a, b) for job, a, b in spans],
                                                  [b - a for _, a, b in spans])
        outs = [share.plan.raw_rows(share.record.view) for share in shares] if held else None
        normalize = shares[0].plan.normalize if len(shares) == 1 else np.concatenate([s.plan.normalize for s in shares])
        try:
            pending, error = slot.engine.submit(pack(sequences, rows), out=outs, normalize=normalize,
                                                lane=lane), None
        except Exception as exc:  # a failed batch fails its requests, not the worker
            pending, error = None, exc
        batch = InFlight(slot, lane, shares, pending, error, start_ns, self.batches)
        slot.open[lane].append(batch)
        self.batches += 1
        return batch

    def reserve(self, link: Link, plan: BatchAnswer) -> Reservation:
        if plan.nbytes > link.responses.max_record:
            raise RuntimeError(f"a batch of {plan.rows} rows needs a {plan.nbytes}-byte record, over the response "
                               f"ring's {link.responses.max_record}; the batcher's row cap should prevent it. "
                               "This is a bug.")
        return self.room(link, lambda: link.responses.reserve(plan.nbytes, timeout=1.0))

    def answer(self, batch: InFlight) -> None:
        """Wait for a batch (taken off its open queue by the caller), fill in and commit its records."""
        error, rows = batch.error, None
        if error is None:
            try:
                rows = batch.pending.result()  # held records: the rows are in them now
            except Exception as exc:
                error = exc
        if error is not None:
            print(f"pollen-worker[{self.cfg.index}]: batch failed: {error!r}", file=sys.stderr, flush=True)
        at = 0
        for share in batch.shares:
            if share.record is None:  # a bulk batch's record, taken now; its rows came to the engine's buffer
                share.record = self.reserve(share.link, share.plan)
                if error is None:
                    np.copyto(share.plan.raw_rows(share.record.view), rows[at:at + share.plan.rows])
                at += share.plan.rows
        end_ns = time.monotonic_ns()
        for share in batch.shares:
            unanswered = share.plan.fill(share.record.view, error, batch.start_ns, end_ns)
            share.link.responses.commit(share.record, records.BATCH_RESULT, notify=False)
            for job in unanswered:  # their last rows were due in a later batch
                self.write_error(job, f"model failed on this batch: {error}")
            # One wake-up per share at most, and none if the frontend is busy reading.
            share.link.responses.notify_consumer()

    def write_error(self, job: Job, message: str, code: int = records.INTERNAL) -> None:
        link = self.links.get(job.source)
        if link is None or link.gone:
            return  # its frontend is gone
        head = records.result_header(job.rec.req_id, code, 0, 0, job.rec.options.encoding, 0, 0)
        self.room(link, lambda: link.responses.write(records.RESULT, head, message.encode()[:4096], timeout=1.0,
                                                     notify=False))

    def room(self, link: Link, take):
        """take() space in `link`'s response ring, waiting for its frontend to read if it is full.

        When only our own open batch records stand in the way (CommitFirst: the frontend cannot
        read past them), finish those batches and commit their records first. That gives up
        overlapping the next batch with them, but only while the ring is that full. A frontend
        that died reads nothing: once the supervisor says so, its ring's answers are dropped
        unread, so the worker never waits on the dead.
        """
        while True:
            try:
                return take()
            except CommitFirst:  # only held records stand in the way: the held ones are interactive
                held = [slot.open[INTERACTIVE] for slot in self.slots if slot.open[INTERACTIVE]]
                if not held:
                    raise
                oldest = min(held, key=lambda queue: queue[0].seq)  # the first record taken
                self.answer(oldest.popleft())
            except TimeoutError:
                self.state.beat(self.cfg.index, self.batches)  # waiting on a live frontend is progress
                self.poll_control()
                if link.gone:
                    link.responses.drop_published()
                if os.getppid() != self.cfg.parent_pid:
                    raise SystemExit(0) from None

    def close(self) -> None:
        self.state.set_ready(self.cfg.index, False)
        for link in self.links.values():
            link.close()
        for slot in self.slots:
            slot.engine.close()
