"""The worker process: drain the request ring, batch by tokens, run the model, answer.

Started by the frontend as `python -m pollen.worker '<WorkerConfig as JSON>'` with the rings'
eventfds passed down (pass_fds). One worker per device; it names itself in its process title,
dies with its parent, and says READY on the response ring once the model is loaded.

Each batch is answered by one BATCH_RESULT record (shared_mem/records.py) whose space is held in
the response ring when the batch is launched: the engine writes the pooled rows straight into
it, and the worker commits it once the batch is done. Batch N+1 is launched before N is awaited,
so two records can be open at once; they are committed in launch order. The worker never waits
for ring space while it holds a record open (the frontend cannot read past it): when only a
commit could make room, it finishes its open batches first (`Worker.room`).
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import sys
import time
from collections import deque

from pollen.common import status
from pollen.common.worker_config import WorkerConfig
from pollen.shared_mem import records
from pollen.shared_mem.ring import CommitFirst, Reservation, Ring
from pollen.worker.batch_answer import BatchAnswer
from pollen.worker.batcher import Batcher, Job
from pollen.worker.packed import pack


@dataclasses.dataclass(slots=True)
class InFlight:
    """A submitted batch: its answer plan, the record held for it, the engine's pending handle
    (or the error submit raised)."""

    plan: BatchAnswer
    record: Reservation
    pending: object
    error: Exception | None
    start_ns: int

    @property
    def computed(self) -> bool:
        """True when the engine already holds the result (the CPU engine computes in submit)."""
        return self.error is not None or getattr(self.pending, "computed", False)


def visible_device(gpu: int, inherited: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the worker of GPU `gpu`, an index as the frontend saw GPUs: the
    gpu-th entry of the frontend's own CUDA_VISIBLE_DEVICES when it had one, else `gpu` itself."""
    if not inherited:
        return str(gpu)
    entries = [v.strip() for v in inherited.split(",") if v.strip()]
    if gpu >= len(entries):
        raise ValueError(f"GPU {gpu} is not among CUDA_VISIBLE_DEVICES={inherited!r}")
    return entries[gpu]


def die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the frontend goes, so no orphan holds a device."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the parent-pid check in the loop still ends us


class Worker:
    def __init__(self, cfg: WorkerConfig):
        import torch

        from pollen.worker.engine import make_engine
        from pollen.worker.models.loader import load_model

        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        # cuda: main() narrowed CUDA_VISIBLE_DEVICES to our one GPU, so it is always cuda:0 here.
        device = "cuda:0" if cfg.device == "cuda" else "cpu"
        self.model = load_model(cfg.model, device=device, dtype=getattr(torch, cfg.dtype),
                                pooling=cfg.pooling, attention=cfg.attention, options=cfg.engine_options)
        self.hidden = self.model.spec.hidden_size
        self.engine = make_engine(self.model, device, max_batch_tokens=cfg.max_batch_tokens,
                                  cuda_graphs=cfg.cuda_graphs, graph_max_tokens=cfg.graph_max_tokens or None)
        self.engine.warm_up()  # pay first-call costs before READY, not on a client
        self.requests = Ring.attach(cfg.request_ring, *cfg.request_fds)
        # An idle worker sleeps in long slices: the frontend re-signals a lost wake-up every
        # few ms while it has requests out (server/workers.py, tick), so a laptop stays quiet.
        self.requests.WAIT_SLICE = 0.5
        self.responses = Ring.attach(cfg.response_ring, *cfg.response_fds)
        # The device copies each batch's rows straight into the response ring's memory.
        self.engine.register_host_memory(*self.responses.mapped_memory())
        # Rows per batch are capped so that a batch's record always fits the ring. Sizing the ring
        # for the token budget instead would mean 2 x max_batch_tokens x hidden x 4 bytes (pinned,
        # on a GPU) for batches of one-token texts that real traffic never sends.
        max_rows = records.max_batch_rows(self.responses.max_record, self.hidden)
        self.batcher = Batcher(cfg.max_batch_tokens, cfg.bulk_batch_tokens, max_rows)
        self.native_int8 = self.model.spec.native_int8
        self.open: deque[InFlight] = deque()  # submitted, record not yet committed; oldest first
        self.stopping = False

    def run(self) -> None:
        ready = {"pid": os.getpid(), "index": self.cfg.index, "device": self.cfg.device, "gpu": self.cfg.gpu,
                 "dtype": self.cfg.dtype,
                 "threads": self.cfg.threads, "model": self.model.spec.name}
        self.responses.write(records.READY, json.dumps(ready).encode())
        while True:
            self.drain_requests()
            self.drop_expired()
            # Submit batch N+1 before waiting on batch N: its packing and launch overlap N's work.
            newest = self.submit(self.batcher.next_batch()) if self.batcher else None
            while self.open and self.open[0] is not newest:
                self.answer(self.open.popleft())
            if self.open and self.open[0].computed:
                # A synchronous engine (the CPU) has finished already: answer now rather than
                # after the next batch, which would add a whole batch to this one's latency.
                self.answer(self.open.popleft())
            if self.open or self.batcher:
                continue
            if self.stopping:
                return
            if self.spin_for_requests():
                continue
            self.requests.wait_readable(timeout=1.0)
            if os.getppid() != self.cfg.parent_pid:
                return  # the frontend is gone; nobody will read our answers

    def spin_for_requests(self) -> bool:
        """Poll the request ring for cfg.spin_us; True as soon as something arrived. A sleeping worker
        costs each query an eventfd write and a scheduler wake-up; a spinning one sees the request
        the moment it is committed (the frontend does not even write the eventfd then)."""
        if self.cfg.spin_us <= 0:
            return False
        deadline = time.monotonic_ns() + self.cfg.spin_us * 1000
        has_data, now = self.requests.has_data, time.monotonic_ns
        while now() < deadline:
            if has_data():
                return True
        return False

    def drain_requests(self) -> None:
        while (item := self.requests.read()) is not None:
            kind, view = item
            if kind == records.EMBED:
                self.batcher.add(Job.of(records.decode_request(view)))
            elif kind == records.CANCEL:
                job = self.batcher.cancel(records.decode_cancel(view))
                if job is not None:
                    self.write_error(job, status.CANCELLED_BEFORE_MODEL,
                                     records.CANCELLED)
            elif kind == records.STOP:
                self.stopping = True
            del view  # the ring may reuse these bytes after release()
        self.requests.release()

    def drop_expired(self) -> None:
        """Answer DEADLINE_EXCEEDED for requests whose deadline passed before they were batched."""
        dropped = self.batcher.expire(time.monotonic_ns())
        for job in dropped:
            self.write_error(job, status.DEADLINE_PASSED,
                             records.DEADLINE_EXCEEDED)
        if dropped:
            self.responses.notify_consumer()

    def submit(self, spans: list[tuple[Job, int, int]]) -> InFlight:
        start_ns = time.monotonic_ns()
        plan = BatchAnswer(spans, self.hidden, self.native_int8)
        if plan.nbytes > self.responses.max_record:
            raise RuntimeError(f"a batch of {plan.rows} rows needs a {plan.nbytes}-byte record, over the response "
                               f"ring's {self.responses.max_record}; the batcher's row cap should prevent it. "
                               "This is a bug.")
        record = self.room(lambda: self.responses.hold(plan.nbytes, timeout=1.0))
        sequences = [job.rec.ids[job.offsets[i]:job.offsets[i + 1]] for job, a, b in spans for i in range(a, b)]
        # Rows differ from sequences only for contextual chunks and CHUNK_MEAN windows.
        plain = all(job.rec.rows is None for job, _, _ in spans)
        row_spans = None if plain else [job.row_spans(i) for job, a, b in spans for i in range(a, b)]
        try:
            pending, error = self.engine.submit(pack(sequences, row_spans), out=plan.raw_rows(record.view),
                                                normalize=plan.normalize), None
        except Exception as exc:  # a failed batch fails its requests, not the worker
            pending, error = None, exc
        batch = InFlight(plan, record, pending, error, start_ns)
        self.open.append(batch)
        return batch

    def answer(self, batch: InFlight) -> None:
        """Wait for a batch (taken off self.open by the caller), fill in and commit its record."""
        error = batch.error
        if error is None:
            try:
                batch.pending.result()  # the rows are in the record now
            except Exception as exc:
                error = exc
        if error is not None:
            print(f"pollen-worker[{self.cfg.index}]: batch failed: {error!r}", file=sys.stderr, flush=True)
        unanswered = batch.plan.fill(batch.record.view, error, batch.start_ns, time.monotonic_ns())
        self.responses.commit_held(batch.record, records.BATCH_RESULT, notify=False)
        for job in unanswered:  # their last rows were due in a later batch
            self.write_error(job, f"model failed on this batch: {error}")
        # One wake-up per batch at most, and none if the frontend is busy reading.
        self.responses.notify_consumer()

    def write_error(self, job: Job, message: str, status: int = records.INTERNAL) -> None:
        rec = job.rec
        text = message.encode()[:4096]
        buf = self.reserve(records.RESULT_HEADER + len(text))
        records.pack_result_header(buf, rec.req_id, status, 0, 0, rec.encoding, 0, 0)
        buf[records.RESULT_HEADER:] = text
        del buf
        self.responses.commit(records.RESULT, notify=False)

    def reserve(self, nbytes: int) -> memoryview:
        """Space in the response ring for a record written now (see `room`)."""
        return self.room(lambda: self.responses.reserve(nbytes, timeout=1.0))

    def room(self, take):
        """take() space in the response ring, waiting for the frontend to read if it is full.

        When only our own open batch records stand in the way (CommitFirst: the frontend cannot
        read past them), finish those batches and commit their records first. That gives up
        overlapping the next batch with them, but only while the ring is that full.
        """
        while True:
            try:
                return take()
            except CommitFirst:
                if not self.open:
                    raise
                self.answer(self.open.popleft())
            except TimeoutError:
                if os.getppid() != self.cfg.parent_pid:
                    raise SystemExit(0) from None

    def close(self) -> None:
        self.engine.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pollen.worker '<WorkerConfig as JSON>' (the server starts workers; see "
              "pollen.common.worker_config)", file=sys.stderr)
        return 2
    cfg = WorkerConfig(**json.loads(argv[0]))
    die_with_parent()
    if cfg.gpu >= 0:
        # Before torch initializes CUDA: this process sees, allocates on and names one GPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device(cfg.gpu, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if cfg.cpu_cores:
        os.sched_setaffinity(0, cfg.cpu_cores)  # our share of the cores, next to our GPU's feeders
    # SIGTERM/SIGINT go to the frontend, which stops us with a STOP record after its work is done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import setproctitle

        where = f"cuda:{cfg.gpu}" if cfg.gpu >= 0 else "cpu"
        setproctitle.setproctitle(f"pollen-worker[{cfg.index}] {where} {os.path.basename(cfg.model)}")
    except ImportError:
        pass
    worker = Worker(cfg)
    try:
        worker.run()
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
