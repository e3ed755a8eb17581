"""The short-request path: small requests are tokenized on the event loop (no hop to the pool),
large ones in the pool; a worker that spins before it sleeps answers like one that sleeps; a
frontend that polls its response ring while a query runs answers like one that sleeps, and stops."""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from pollen.common.model_spec import default_model_path, read_model_spec
from pollen.server.admission import INLINE_CHARS, Admission
from pollen.server.config import ServeConfig
from pollen.server.tokenizer import TextTokenizer
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, cosine_rows, vectors


class CountingPool(ThreadPoolExecutor):
    """A real thread pool that counts the work handed to it."""

    def __init__(self):
        super().__init__(2)
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_short_requests_tokenize_inline_and_long_ones_in_the_pool():
    spec = read_model_spec(default_model_path())
    tokenizer = TextTokenizer(default_model_path(), spec.max_tokens)
    pool = CountingPool()
    admission = Admission(spec, tokenizer, pool, max_texts=64)
    short = ["what is the capital of france?", "a query"]
    long = ["word " * (INLINE_CHARS // 5 + 10)]

    async def admit(texts):
        return await admission.admit(pb.EmbedRequest(texts=texts, truncate=pb.TRUNCATE_END))

    try:
        got = asyncio.run(admit(short))
        assert pool.submitted == 0
        for seq, want in zip(got.seqs, tokenizer.encode(short, pb.TRUNCATE_END)):
            np.testing.assert_array_equal(seq, want)
        got = asyncio.run(admit(long))
        assert pool.submitted == 1
        np.testing.assert_array_equal(got.seqs[0], tokenizer.encode(long, pb.TRUNCATE_END)[0])
    finally:
        pool.shutdown()


def test_worker_spin_defaults_by_device():
    assert ServeConfig.from_args([], environ={}).worker_spin_us == 0
    assert ServeConfig.from_args(["--device", "cuda", "--devices", "0"], environ={}).worker_spin_us == 5000
    assert ServeConfig.from_args(["--worker-spin-us", "200"], environ={}).worker_spin_us == 200


def test_frontend_spin_defaults_by_device():
    assert ServeConfig.from_args([], environ={}).frontend_spin_us == 0
    assert ServeConfig.from_args(["--device", "cuda", "--devices", "0"], environ={}).frontend_spin_us == 3000
    assert ServeConfig.from_args(["--frontend-spin-us", "200"], environ={}).frontend_spin_us == 200


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_call(stub, frontend: int, request: pb.EmbedRequest) -> tuple[np.ndarray, float]:
    """The call's vectors and the frontend's CPU time over it, as a share of its wall time."""
    wall, cpu = time.monotonic(), cpu_seconds(frontend)
    got = vectors(stub.Embed(request, timeout=120))
    return got, (cpu_seconds(frontend) - cpu) / (time.monotonic() - wall)


def test_spinning_frontend_answers_polls_only_for_interactive_work_and_stops(reference):
    """A spin long enough to cover the whole call: the frontend polls (busy) while an interactive
    request runs, sleeps while a bulk one runs, and is quiet once nothing is out."""
    srv = ServerProcess("--frontend-spin-us", "30000000", "--log-level", "WARNING").start()
    texts = [f"document {i}: " + "a fairly long sentence about polling rings and sleeping cores " * 12
             for i in range(96)]
    try:
        frontend = next(pid for pid in srv.child_pids()
                        if open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"pollen-frontend"))
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            bulk, bulk_busy = timed_call(stub, frontend, pb.EmbedRequest(texts=texts, normalize=True,
                                                                         priority=pb.PRIORITY_BULK))
            interactive, interactive_busy = timed_call(stub, frontend, pb.EmbedRequest(texts=texts, normalize=True))
            singles = [vectors(stub.Embed(pb.EmbedRequest(texts=[t], normalize=True), timeout=30))[0]
                       for t in texts[:8]]
            time.sleep(0.3)
            idle_from = cpu_seconds(frontend)
            time.sleep(1.0)
            idle = cpu_seconds(frontend) - idle_from
        want = reference(texts)
        for got in (bulk, interactive, np.stack(singles)):
            assert cosine_rows(got, want[:len(got)]).min() >= 0.9999
        assert interactive_busy >= 0.3, f"the frontend used {interactive_busy:.0%} of a core while polling"
        assert bulk_busy <= 0.15, f"the frontend used {bulk_busy:.0%} of a core while a bulk request ran"
        assert idle <= 0.15, f"the frontend used {idle:.2f} s of CPU in 1 s with nothing out"
    finally:
        srv.terminate()


def test_spinning_worker_answers_every_request(reference):
    srv = ServerProcess("--worker-spin-us", "3000", "--log-level", "WARNING").start()
    texts = [f"query number {i} about spinning workers" for i in range(40)]
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            # One at a time, some while the worker spins and some after it went to sleep.
            got = []
            for i, text in enumerate(texts):
                got.append(vectors(stub.Embed(pb.EmbedRequest(texts=[text], normalize=True), timeout=30))[0])
                if i % 10 == 9:
                    time.sleep(0.01)  # past the spin: the next one must wake a sleeping worker
        assert cosine_rows(np.stack(got), reference(texts)).min() >= 0.9999
    finally:
        srv.terminate()
