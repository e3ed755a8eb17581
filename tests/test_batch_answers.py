"""Answers out of batch records through a real server whose batches are small (--max-batch-tokens
256), all sent at once: batches then mix requests of every kind, requests spread over several
batches, and some batches end requests begun earlier while others begin new ones. Each answer
must equal the same request answered alone by the session server (one request per batch there).

Kinds: float32 normalized or not (answered by the raw rows, normalized in the engine), Matryoshka
dims, every encoding, contextual chunks, CHUNK_MEAN, and requests larger than one batch in
float32 and int8. A failed batch cannot be provoked through a server; tests/test_batch_record.py
fails one in the worker's own loop.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, embed_all_at_once
from tests.test_chunks import CHUNKS

SHORT = ["a short text", "東京 🙂", "magnets and how they work", "the weather in the mountains in spring"]
MANY = [f"sentence number {i} is about topic {i % 7} and a little about the sea" for i in range(40)]
LONG = " ".join(f"sentence {i} talks about topic {i % 7} and the weather." for i in range(60))


def cases() -> list[pb.EmbedRequest]:
    out = [pb.EmbedRequest(texts=SHORT), pb.EmbedRequest(texts=SHORT, normalize=True),
           pb.EmbedRequest(texts=SHORT, dimensions=32, normalize=True),
           pb.EmbedRequest(texts=SHORT, dimensions=100)]
    for encoding in (pb.ENCODING_FLOAT16, pb.ENCODING_BFLOAT16, pb.ENCODING_INT8, pb.ENCODING_UBINARY):
        out.append(pb.EmbedRequest(texts=SHORT, normalize=True, encoding=encoding))
    out += [pb.EmbedRequest(chunks=CHUNKS, normalize=True), pb.EmbedRequest(chunks=CHUNKS, dimensions=64),
            pb.EmbedRequest(texts=[LONG, "a short text"], long_input=pb.LONG_INPUT_CHUNK_MEAN, normalize=True),
            pb.EmbedRequest(texts=MANY, normalize=True), pb.EmbedRequest(texts=MANY),
            pb.EmbedRequest(texts=MANY, encoding=pb.ENCODING_INT8, dimensions=64)]
    return out


def values(reply: pb.EmbedResponse) -> np.ndarray:
    """An answer's values as float64 [rows, dims] (int8 dequantized, bits as 0/1)."""
    assert not reply.HasField("error"), reply.error.message
    shape = (reply.rows, reply.dims)
    if reply.encoding == pb.ENCODING_FLOAT32:
        return np.frombuffer(reply.embeddings, "<f4").reshape(shape).astype(np.float64)
    if reply.encoding == pb.ENCODING_FLOAT16:
        return np.frombuffer(reply.embeddings, "<f2").reshape(shape).astype(np.float64)
    if reply.encoding == pb.ENCODING_BFLOAT16:
        bits = np.frombuffer(reply.embeddings, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape).astype(np.float64)
    if reply.encoding == pb.ENCODING_INT8:
        q = np.frombuffer(reply.embeddings, np.int8).reshape(shape).astype(np.float64)
        return q * np.asarray(reply.scales)[:, None]
    packed = np.frombuffer(reply.embeddings, np.uint8).reshape(reply.rows, -1)
    return np.unpackbits(packed, axis=1, bitorder="little")[:, :reply.dims].astype(np.float64)


# Batch composition moves float32 results by rounding only; each encoding then rounds once more.
TOLERANCE = {pb.ENCODING_FLOAT32: 2e-5, pb.ENCODING_FLOAT16: 1e-3, pb.ENCODING_BFLOAT16: 8e-3}


@pytest.fixture(scope="module")
def small_batches():
    srv = ServerProcess("--max-batch-tokens", "256", "--max-texts-per-request", "64").start()
    yield srv
    assert srv.terminate() == 0


def test_mixed_small_batches_answer_every_kind_as_a_lone_request(small_batches, stub):
    requests = cases() * 3
    got = embed_all_at_once(small_batches.listen, requests, timeout=120)
    for request, reply in zip(requests, got):
        want = stub.Embed(request, timeout=60)
        assert (reply.rows, reply.dims, reply.encoding) == (want.rows, want.dims, want.encoding)
        a, b = values(reply), values(want)
        if reply.encoding == pb.ENCODING_INT8:
            np.testing.assert_allclose(a, b, atol=1.01 * max(max(reply.scales), max(want.scales)))
        elif reply.encoding == pb.ENCODING_UBINARY:
            assert (a != b).mean() < 0.01  # a bit may flip where a value is within rounding of 0
        else:
            np.testing.assert_allclose(a, b, atol=TOLERANCE[reply.encoding], rtol=TOLERANCE[reply.encoding])
        if request.normalize and request.encoding == pb.ENCODING_FLOAT32:
            np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1, atol=1e-6)


def test_every_batch_is_reported_and_every_request_answered_once(small_batches):
    with grpc.insecure_channel(small_batches.listen) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        reply = stub.Embed(pb.EmbedRequest(texts=MANY, normalize=True), timeout=60)
        assert reply.rows == len(MANY) and reply.usage.prompt_tokens > 256  # more than one batch
    # The batch records fed the metric (one observation per batch, several for this request).
    import urllib.request

    text = urllib.request.urlopen(f"http://{small_batches.http_listen}/metrics", timeout=10).read().decode()
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("pollen_batch_tokens_count"))
    assert count >= 3
