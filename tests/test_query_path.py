"""The short-request path: small requests are tokenized on the event loop (no hop to the pool),
large ones in the pool; a worker that spins before it sleeps answers like one that sleeps."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from pollen.common.model_spec import default_model_path, read_model_spec
from pollen.server.config import ServeConfig
from pollen.server.pipeline.admission import INLINE_CHARS, Admission
from pollen.server.pipeline.tokenizer import TextTokenizer
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
