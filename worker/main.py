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
from worker.postprocess import combine, finish, row_bytes


@dataclasses.dataclass(slots=True)
class InFlight:
    """A submitted batch: its spans, the engine's pending handle (or the error submit raised)."""

    spans: list
    pending: object
    error: Exception | None
    start_ns: int
    report: bytes  # the BATCH record: tokens, sequences, rows and request ids of this batch

    @property
    def computed(self) -> bool:
        """True when the engine already holds the result (the CPU engine computes in submit)."""
        return self.error is not None or getattr(self.pending, "computed", False)


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
    bulk_batch_tokens: int = 0  # cap on bulk tokens per batch; 0: max_batch_tokens
    spin_us: int = 0  # poll the request ring this long before sleeping (ServeConfig.worker_spin_us)

    def __post_init__(self) -> None:
        self.request_fds = tuple(self.request_fds)
        self.response_fds = tuple(self.response_fds)
        if self.threads < 1 or self.max_batch_tokens < 1:
            raise ValueError(f"threads and max_batch_tokens must be positive: {self}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


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
        self.batcher = Batcher(cfg.max_batch_tokens, cfg.bulk_batch_tokens)
        self.native_int8 = self.model.spec.native_int8
        self.stopping = False

    def run(self) -> None:
        ready = {"pid": os.getpid(), "index": self.cfg.index, "device": self.cfg.device, "gpu": self.cfg.gpu,
                 "dtype": self.cfg.dtype,
                 "threads": self.cfg.threads, "model": self.model.spec.name}
        self.responses.write(records.READY, json.dumps(ready).encode())
        in_flight: InFlight | None = None
        while True:
            self.drain_requests()
            self.drop_expired()
            # Submit batch N+1 before waiting on batch N: its packing and launch overlap N's work.
            following = self.submit(self.batcher.next_batch()) if self.batcher else None
            if in_flight is not None:
                self.answer(in_flight)
            in_flight = following
            if in_flight is not None and in_flight.computed:
                # A synchronous engine (the CPU) has finished already: answer now rather than
                # after the next batch, which would add a whole batch to this one's latency.
                self.answer(in_flight)
                in_flight = None
            if in_flight is not None or self.batcher:
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
                    self.write_error(job, "the client cancelled the request before it reached the model",
                                     records.CANCELLED)
            elif kind == records.STOP:
                self.stopping = True
            del view  # the ring may reuse these bytes after release()
        self.requests.release()

    def drop_expired(self) -> None:
        """Answer DEADLINE_EXCEEDED for requests whose deadline passed before they were batched."""
        dropped = self.batcher.expire(time.monotonic_ns())
        for job in dropped:
            self.write_error(job, "the deadline passed before the request reached the model",
                             records.DEADLINE_EXCEEDED)
        if dropped:
            self.responses.notify_consumer()

    def submit(self, spans: list[tuple[Job, int, int]]) -> "InFlight":
        start_ns = time.monotonic_ns()
        sequences = [job.rec.ids[job.offsets[i]:job.offsets[i + 1]] for job, a, b in spans for i in range(a, b)]
        # Rows differ from sequences only for contextual chunks and CHUNK_MEAN windows.
        plain = all(job.rec.rows is None for job, _, _ in spans)
        row_spans = None if plain else [job.row_spans(i) for job, a, b in spans for i in range(a, b)]
        try:
            pending, error = self.engine.submit(pack(sequences, row_spans)), None
        except Exception as exc:  # a failed batch fails its requests, not the worker
            pending, error = None, exc
        report = records.encode_batch(sum(len(s) for s in sequences), len(sequences),
                                      sum(len(r) for r in row_spans) if row_spans else len(sequences),
                                      [job.rec.req_id for job, _, _ in spans])
        return InFlight(spans, pending, error, start_ns, report)

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
                job.pooled = np.empty((job.n_rows, self.hidden), dtype=np.float32)
            ra, rb = int(job.row_offsets[a]), int(job.row_offsets[b])
            job.pooled[ra:rb] = pooled[row:row + (rb - ra)]
            row += rb - ra
            job.done_seqs += b - a
            if job.done_seqs == job.n_seqs:
                self.write_result(job)
        buf = self.reserve(len(batch.report))
        buf[:] = batch.report
        del buf
        self.responses.commit(records.BATCH, notify=False)
        # One wake-up per batch at most, and none if the frontend is busy reading.
        self.responses.notify_consumer()

    def write_result(self, job: Job) -> None:
        rec = job.rec
        dims = rec.dims or self.hidden
        vectors = job.pooled
        if rec.rows is not None:  # contextual chunks (weights 1, one row each) or CHUNK_MEAN windows
            vectors = combine(job.pooled, rec.rows.out.astype(np.int64), rec.rows.weight.astype(np.float64), rec.n_out)
        rows = len(vectors)
        body = rows * row_bytes(dims, rec.encoding)
        buf = self.reserve(records.RESULT_HEADER + body)
        records.pack_result_header(buf, rec.req_id, 0, rows, dims, rec.encoding,
                                   max(0, job.last_start_ns - rec.admit_ns) // 1000,
                                   (job.last_end_ns - job.first_start_ns) // 1000)
        finish(vectors, rec.dims, rec.normalize, rec.encoding, buf[records.RESULT_HEADER:], self.native_int8)
        del buf
        self.responses.commit(records.RESULT, notify=False)

    def write_error(self, job: Job, message: str, status: int = records.INTERNAL) -> None:
        rec = job.rec
        text = message.encode()[:4096]
        buf = self.reserve(records.RESULT_HEADER + len(text))
        records.pack_result_header(buf, rec.req_id, status, 0, 0, rec.encoding, 0, 0)
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
    Worker(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
