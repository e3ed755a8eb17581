"""The worker process: drain the request ring, batch by tokens, run the model, answer.

Started by the frontend as `python -m worker.main '<WorkerConfig as JSON>'` with the rings'
eventfds passed down (pass_fds). One worker per device; it names itself in its process title,
dies with its parent, and says READY on the response ring once the model is loaded.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import sys
import time

import numpy as np

from shared_mem import records
from shared_mem.ring import Ring
from worker.batcher import Batcher, Job
from worker.packed import pack
from worker.postprocess import finish, row_bytes


@dataclasses.dataclass(slots=True)
class InFlight:
    """A submitted batch: its spans, the engine's pending handle (or the error submit raised)."""

    spans: list
    pending: object
    error: Exception | None
    start_ns: int


@dataclasses.dataclass(slots=True)
class WorkerConfig:
    index: int
    model: str
    device: str
    threads: int
    max_batch_tokens: int
    parent_pid: int
    request_ring: str
    request_fds: tuple[int, int]   # (data_fd, space_fd)
    response_ring: str
    response_fds: tuple[int, int]
    gpu: int = -1                 # cuda: the physical GPU index this worker owns; -1 on the cpu
    cpu_cores: list = dataclasses.field(default_factory=list)  # affinity; empty: leave as is
    dtype: str = "float32"
    cuda_graphs: bool = True
    graph_max_tokens: int = 8192
    pooling: str | None = None
    attention: str | None = None

    def __post_init__(self) -> None:
        self.request_fds = tuple(self.request_fds)
        self.response_fds = tuple(self.response_fds)
        if self.threads < 1 or self.max_batch_tokens < 1:
            raise ValueError(f"threads and max_batch_tokens must be positive: {self}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


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

        from worker.engine import make_engine
        from worker.models.loader import load_model

        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        # cuda: main() narrowed CUDA_VISIBLE_DEVICES to our one GPU, so it is always cuda:0 here.
        device = "cuda:0" if cfg.device == "cuda" else "cpu"
        self.model = load_model(cfg.model, device=device, dtype=getattr(torch, cfg.dtype),
                                pooling=cfg.pooling, attention=cfg.attention)
        self.hidden = self.model.spec.hidden_size
        self.engine = make_engine(self.model, device, max_batch_tokens=cfg.max_batch_tokens,
                                  cuda_graphs=cfg.cuda_graphs, graph_max_tokens=cfg.graph_max_tokens or None)
        self.engine.warm_up()  # pay first-call costs before READY, not on a client
        self.requests = Ring.attach(cfg.request_ring, *cfg.request_fds)
        # An idle worker sleeps in long slices: the frontend re-signals a lost wake-up every
        # few ms while it has requests out (server/workers.py, tick), so a laptop stays quiet.
        self.requests.WAIT_SLICE = 0.5
        self.responses = Ring.attach(cfg.response_ring, *cfg.response_fds)
        self.batcher = Batcher(cfg.max_batch_tokens)
        self.stopping = False

    def run(self) -> None:
        ready = {"pid": os.getpid(), "index": self.cfg.index, "device": self.cfg.device, "gpu": self.cfg.gpu,
                 "dtype": self.cfg.dtype,
                 "threads": self.cfg.threads, "model": self.model.spec.name}
        self.responses.write(records.READY, json.dumps(ready).encode())
        in_flight: InFlight | None = None
        while True:
            self.drain_requests()
            # Submit batch N+1 before waiting on batch N: its packing and launch overlap N's work.
            following = self.submit(self.batcher.next_batch()) if self.batcher else None
            if in_flight is not None:
                self.answer(in_flight)
            in_flight = following
            if in_flight is not None or self.batcher:
                continue
            if self.stopping:
                return
            self.requests.wait_readable(timeout=1.0)
            if os.getppid() != self.cfg.parent_pid:
                return  # the frontend is gone; nobody will read our answers

    def drain_requests(self) -> None:
        while (item := self.requests.read()) is not None:
            kind, view = item
            if kind == records.EMBED:
                self.batcher.add(Job.of(records.decode_request(view)))
            elif kind == records.STOP:
                self.stopping = True
            del view  # the ring may reuse these bytes after release()
        self.requests.release()

    def submit(self, spans: list[tuple[Job, int, int]]) -> "InFlight":
        start_ns = time.monotonic_ns()
        sequences = [job.rec.ids[job.offsets[i]:job.offsets[i + 1]] for job, a, b in spans for i in range(a, b)]
        try:
            pending, error = self.engine.submit(pack(sequences)), None
        except Exception as exc:  # a failed batch fails its requests, not the worker
            pending, error = None, exc
        return InFlight(spans, pending, error, start_ns)

    def answer(self, batch: "InFlight") -> None:
        error = batch.error
        pooled = None
        if error is None:
            try:
                pooled = batch.pending.result()
            except Exception as exc:
                error = exc
        if error is not None:
            print(f"pollen-worker[{self.cfg.index}]: batch failed: {error!r}", file=sys.stderr, flush=True)
        end_ns = time.monotonic_ns()
        row = 0
        for job, a, b in batch.spans:
            if job.first_start_ns == 0:
                job.first_start_ns = batch.start_ns
            job.last_start_ns, job.last_end_ns = batch.start_ns, end_ns
            if job.done_seqs < 0:
                continue  # already answered with an error
            if error is not None:
                self.write_error(job, f"model failed on this batch: {error}")
                job.done_seqs = -1  # answered; its later spans are dropped
                continue
            if job.pooled is None:
                job.pooled = np.empty((job.n_seqs, self.hidden), dtype=np.float32)
            job.pooled[a:b] = pooled[row:row + (b - a)]
            row += b - a
            job.done_seqs += b - a
            if job.done_seqs == job.n_seqs:
                self.write_result(job)
        # One wake-up per batch at most, and none if the frontend is busy reading.
        self.responses.notify_consumer()

    def write_result(self, job: Job) -> None:
        rec = job.rec
        dims = rec.dims or self.hidden
        body = job.n_seqs * row_bytes(dims, rec.encoding)
        buf = self.reserve(records.RESULT_HEADER + body)
        records.pack_result_header(buf, rec.req_id, 0, job.n_seqs, dims, rec.encoding,
                                   max(0, job.last_start_ns - rec.admit_ns) // 1000,
                                   (job.last_end_ns - job.first_start_ns) // 1000)
        finish(job.pooled, rec.dims, rec.normalize, rec.encoding, buf[records.RESULT_HEADER:])
        del buf
        self.responses.commit(records.RESULT, notify=False)

    def write_error(self, job: Job, message: str) -> None:
        rec = job.rec
        text = message.encode()[:4096]
        buf = self.reserve(records.RESULT_HEADER + len(text))
        records.pack_result_header(buf, rec.req_id, 13, 0, 0, rec.encoding, 0, 0)  # 13 = INTERNAL
        buf[records.RESULT_HEADER:] = text
        del buf
        self.responses.commit(records.RESULT, notify=False)

    def reserve(self, nbytes: int) -> memoryview:
        """Space in the response ring, waiting for the frontend to read if it is full."""
        while True:
            try:
                return self.responses.reserve(nbytes, timeout=1.0)
            except TimeoutError:
                if os.getppid() != self.cfg.parent_pid:
                    raise SystemExit(0) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = WorkerConfig(**json.loads(argv[0]))
    die_with_parent()
    if cfg.gpu >= 0:
        # Before torch initializes CUDA: this process sees, allocates on and names one GPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(cfg.gpu)
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
    Worker(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
