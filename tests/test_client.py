"""pollen_client against the real server: vectors, encodings, request splitting, ordered streams,
a stream that survives the server being killed and started again on the same port, and one
given up, with pauses between tries, when a server ends every stream."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest

from pollen.client import AsyncClient, Client, EmbedError, ScaledInt8Array
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, cosine_rows, free_port, vectors
from tests.texts import varied_texts


@pytest.fixture(scope="module")
def client(server):
    with Client(server.listen) as c:
        yield c


def grpc_float(stub, texts, **options) -> np.ndarray:
    return vectors(stub.Embed(pb.EmbedRequest(texts=texts, normalize=True, **options), timeout=60))


def test_embed_splits_over_the_server_limit_and_matches_reference(client, reference):
    texts = [t for t in varied_texts(150) if len(t) < 500]  # short enough to need no truncation
    assert client.info().max_texts_per_request == 64 < len(texts)
    got = client.embed(texts)
    assert got.shape == (len(texts), 384) and got.dtype == np.float32
    assert cosine_rows(got, reference(texts)).min() > 0.999


def test_embed_decodes_every_encoding(client, stub):
    texts = ["first text", "東京 🙂", "third"]
    want = grpc_float(stub, texts, dimensions=64)
    np.testing.assert_allclose(client.embed(texts, dimensions=64), want, atol=2e-6)
    f16 = client.embed(texts, dimensions=64, encoding="float16")
    assert f16.dtype == np.float16
    np.testing.assert_allclose(f16, want.astype(np.float16), atol=2e-3)
    bf16 = client.embed(texts, dimensions=64, encoding=pb.ENCODING_BFLOAT16)
    assert bf16.dtype == np.float32
    np.testing.assert_allclose(bf16, want, rtol=2 ** -8)
    bits = client.embed(texts, dimensions=64, encoding="ubinary")
    assert bits.dtype == np.uint8 and bits.shape == (3, 8)
    np.testing.assert_array_equal(np.unpackbits(bits, axis=1, bitorder="little"), want > 0)
    q = client.embed(texts, dimensions=64, encoding="int8")
    assert isinstance(q, ScaledInt8Array) and q.dtype == np.int8 and q.scales.shape == (3,)
    assert cosine_rows(q.dequantize(), want).min() > 0.99


def test_bad_options_and_inputs_are_clear(client):
    with pytest.raises(ValueError, match="encoding='int4' is not one of"):
        client.embed(["x"], encoding="int4")
    with pytest.raises(EmbedError) as caught:
        client.embed(["fine", ""])
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "texts[1] is empty" in caught.value.message


def stream_inputs() -> list:
    texts = [t for t in varied_texts(120) if len(t) < 500]
    # Single texts and small batches mixed: each batch is one message.
    return [texts[i:i + 3] if i % 5 == 0 else texts[i] for i in range(len(texts))]


def check_answers(inputs: list, answers: list, stub) -> None:
    assert len(answers) == len(inputs)
    flat = [t for item in inputs for t in ([item] if isinstance(item, str) else item)]
    want = grpc_float(stub, flat[:64]), grpc_float(stub, flat[64:128]), grpc_float(stub, flat[128:])
    want = np.concatenate(want)
    got = np.concatenate([a[None] if isinstance(item, str) else a for item, a in zip(inputs, answers)])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_stream_answers_in_input_order(client, stub):
    inputs = stream_inputs()
    answers = list(client.embed_stream(inputs, in_flight=7))
    assert all(a.ndim == (1 if isinstance(i, str) else 2) for i, a in zip(inputs, answers))
    check_answers(inputs, answers, stub)


def test_async_client_embed_and_stream(server, stub):
    inputs = stream_inputs()

    async def main():
        async with AsyncClient(server.listen) as aclient:
            whole = await aclient.embed(["hello", "world"])
            answers = [a async for a in aclient.embed_stream(inputs, in_flight=5)]
        return whole, answers

    whole, answers = asyncio.run(main())
    np.testing.assert_allclose(whole, grpc_float(stub, ["hello", "world"]), atol=2e-6)
    check_answers(inputs, answers, stub)


@pytest.mark.slow
def test_async_client_sends_many_pieces_within_the_servers_stream_bound():
    """2,000 texts, one a request: 2,000 calls at once over the client's two connections, far more
    on each than the server's --grpc-max-streams-per-connection lets one connection keep (sent
    all at once, some are refused REFUSED_STREAM). The client keeps IN_FLIGHT on each, so none
    is."""
    texts = [f"piece {i} of a long list" for i in range(2000)]
    srv = ServerProcess("--max-texts-per-request", "1").start()
    try:
        async def main():
            async with AsyncClient(srv.listen) as aclient:
                return await aclient.embed(texts)

        rows = asyncio.run(main())
        assert rows.shape == (2000, 384)
        with grpc.insecure_channel(srv.listen) as channel:
            assert cosine_rows(rows[-1:], grpc_float(pb_grpc.EmbedderStub(channel), texts[-1:])).min() > 0.9999
    finally:
        assert srv.terminate() == 0


def test_stream_error_names_the_message(client):
    with pytest.raises(EmbedError) as caught:
        list(client.embed_stream(["ok", "", "never reached"], in_flight=1))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.request_id == "1"


def restart_later(server: ServerProcess, after: threading.Event, started: list) -> threading.Thread:
    """Once `after` is set: SIGKILL the server, then start a new one on the same ports."""
    def run():
        after.wait()
        server.kill()
        started.append(ServerProcess(listen=server.listen, http_listen=server.http_listen).start())
    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_stream_survives_a_server_restart(kind, reference):
    texts = [t for t in varied_texts(400, seed=11) if len(t) < 500]
    first = ServerProcess().start()
    midway, started = threading.Event(), []
    restarter = restart_later(first, midway, started)
    answers = []
    try:
        if kind == "sync":
            with Client(first.listen) as c:
                for vector in c.embed_stream(texts, in_flight=8):
                    answers.append(vector)
                    if len(answers) == 50:
                        midway.set()  # killed while the stream has messages in flight
        else:
            async def main():
                async with AsyncClient(first.listen) as c:
                    async for vector in c.embed_stream(texts, in_flight=8):
                        answers.append(vector)
                        if len(answers) == 50:
                            midway.set()
            asyncio.run(main())
        restarter.join()
        assert started and started[0].pid != first.pid  # the rest came from the new server
    finally:
        midway.set()
        restarter.join()
        for srv in started:
            assert srv.terminate() == 0
    assert len(answers) == len(texts)  # each input answered once, in order
    assert cosine_rows(np.stack(answers), reference(texts)).min() > 0.999


class EndsEveryStream(pb_grpc.EmbedderServicer):
    """A stand-in server (real gRPC on a real socket; pollen itself never ends every stream of a
    client while it takes connections): Info answers, every EmbedStream ends UNAVAILABLE at once."""

    def __init__(self):
        self.streams = 0

    def Info(self, request, context):
        return pb.InfoResponse(model="stand-in", dimensions=4, max_texts_per_request=8)

    def EmbedStream(self, request_iterator, context):
        self.streams += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "stand-in: this stream ends at once")
        yield pb.EmbedResponse()  # never reached: makes this a generator, as a stream handler is


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_stream_gives_up_on_a_stand_in_server_that_ends_every_stream(kind):
    from concurrent.futures import ThreadPoolExecutor

    servicer = EndsEveryStream()
    stand_in = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_EmbedderServicer_to_server(servicer, stand_in)
    port = stand_in.add_insecure_port("127.0.0.1:0")
    stand_in.start()
    within = 2.0
    t0 = time.monotonic()
    try:
        with pytest.raises(EmbedError) as gave_up:
            if kind == "sync":
                with Client(f"127.0.0.1:{port}") as c:
                    list(c.embed_stream(["a", "b", "c"], reconnect_within=within))
            else:
                async def main():
                    async with AsyncClient(f"127.0.0.1:{port}") as c:
                        return [v async for v in c.embed_stream(["a", "b", "c"], reconnect_within=within)]
                asyncio.run(main())
    finally:
        stand_in.stop(None)
    took = time.monotonic() - t0
    assert gave_up.value.code == grpc.StatusCode.UNAVAILABLE and "stream abandoned" in gave_up.value.message
    assert within <= took < within + 5  # given up once `within` passed without an answer, not before
    # Tried again with pauses doubling from 50 ms to 1 s: about 7 streams in 2 s, not thousands.
    assert 3 <= servicer.streams <= 15, servicer.streams


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_no_server_at_the_address_is_unavailable_soon(kind):
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    within = 2.0

    def attempts():
        if kind == "sync":
            with Client(nobody) as c:  # the default timeout (300 s) is not what bounds these
                yield lambda: c.embed(["a"])
                yield lambda: list(c.embed_stream(["a", "b"], reconnect_within=within))
        else:
            async def embed():
                async with AsyncClient(nobody) as c:
                    return await c.embed(["a"])

            async def stream():
                async with AsyncClient(nobody) as c:
                    return [v async for v in c.embed_stream(["a", "b"], reconnect_within=within)]
            yield lambda: asyncio.run(embed())
            yield lambda: asyncio.run(stream())

    for attempt in attempts():
        t0 = time.monotonic()
        with pytest.raises(EmbedError) as caught:
            attempt()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE and nobody in caught.value.message
        assert time.monotonic() - t0 < within + 5
