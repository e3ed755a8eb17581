"""Clients that misbehave over real gRPC: bytes that are not a request, a stream message that
does not decode, a stream that writes and never reads. Each gets a clear status or pushback,
and nobody else loses anything."""
from __future__ import annotations

import asyncio
import pathlib
import random
import time

import grpc
import pytest

from pollen.server.config import ServeConfig
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, vectors
from tests.test_prompt_bounds import memory_mb, reset_peak

EMBED = "/pollen.v1.Embedder/Embed"
EMBED_STREAM = "/pollen.v1.Embedder/EmbedStream"
WINDOW = 16  # --max-stream-in-flight of this file's server


def garbage(rng: random.Random) -> bytes:
    """Bytes that never decode: field 0 with the invalid wire type 7, then noise."""
    return b"\x07" + rng.randbytes(rng.randint(0, 300))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    srv = ServerProcess("--max-stream-in-flight", str(WINDOW), log=str(log)).start()
    yield srv
    assert srv.terminate() == 0


def test_garbage_unary_bodies_are_invalid_argument_and_logged_once(hostile):
    rng = random.Random(5)
    with grpc.insecure_channel(hostile.listen) as channel:
        raw = channel.unary_unary(EMBED, request_serializer=None, response_deserializer=None)
        codes, details = [], set()
        for _ in range(50):
            with pytest.raises(grpc.RpcError) as err:
                raw(garbage(rng), timeout=10)
            codes.append(err.value.code())
            details.add(err.value.details())
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 50
        assert details == {"the request is not a valid pollen.v1.EmbedRequest: wire format was corrupt in a field "
                           "numbered 0"}
        stub = pb_grpc.EmbedderStub(channel)
        assert vectors(stub.Embed(pb.EmbedRequest(texts=["still fine"]), timeout=30)).shape == (1, 384)
    lines = pathlib.Path(hostile.log).read_text(errors="replace").splitlines()
    about = [line for line in lines if "not a valid" in line]
    assert 1 <= len(about) <= 2, about
    assert not any("Traceback" in line or " ERROR " in line for line in lines), lines[-20:]


def test_a_refusal_names_the_field_whose_bytes_do_not_decode(hostile):
    good = pb.EmbedRequest(texts=["a bee", "XX", "a hive"], dimensions=128).SerializeToString()
    cases = {good.replace(b"XX", b"\xff\xfe"): "string field had bad UTF-8 in texts[1]",
             good[:-1]: "wire format was corrupt in dimensions",
             good + b"\x12\x09a": "wire format was corrupt in texts[3]"}
    with grpc.insecure_channel(hostile.listen) as channel:
        raw = channel.unary_unary(EMBED, request_serializer=None, response_deserializer=None)
        for data, named in cases.items():
            with pytest.raises(grpc.RpcError) as err:
                raw(data, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == f"the request is not a valid pollen.v1.EmbedRequest: {named}"


def test_undecodable_stream_message_ends_the_stream_after_the_earlier_answers(hostile):
    good = [pb.EmbedRequest(id=f"g{i}", texts=[f"sentence {i}"] * 3) for i in range(4)]
    sent = [g.SerializeToString() for g in good[:3]] + [b"\x07not a message"] + [good[3].SerializeToString()]
    with grpc.insecure_channel(hostile.listen) as channel:
        raw = channel.stream_stream(EMBED_STREAM, request_serializer=None,
                                    response_deserializer=pb.EmbedResponse.FromString)
        call = raw(iter(sent), timeout=60)
        answers = {}
        with pytest.raises(grpc.RpcError) as err:
            for response in call:
                answers.setdefault(response.id, []).append(response)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == ("message 4 of this stream is not a valid pollen.v1.EmbedRequest: wire format "
                                       "was corrupt in a field numbered 0")
        assert sorted(answers) == ["g0", "g1", "g2"]  # every message before it; none after
        assert all(len(a) == 1 and vectors(a[0]).shape == (3, 384) for a in answers.values())
    assert hostile.healthy()


def test_a_stream_that_never_reads_is_held_back_and_then_answered_once(hostile):
    async def main():
        async with grpc.aio.insecure_channel(hostile.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            return await never_reads_then_reads(stub, hostile)

    sent_when_stalled, peak_growth, answers, total = asyncio.run(main())
    print(f"writes stalled after {sent_when_stalled} messages; frontend peak RSS +{peak_growth} MB")
    assert sent_when_stalled < total  # the server stopped reading: flow control held the client
    assert peak_growth < 64
    assert sorted(answers) == sorted(f"m{i}" for i in range(total))
    assert all(len(replies) == 1 for replies in answers.values())
    assert all(not r[0].HasField("error") and r[0].rows == 1 for r in answers.values())


TOTAL = 6_000
BODY = "word " * 1600  # 8 KB a message on the wire; max_tokens keeps the model's share small


async def never_reads_then_reads(stub, server) -> tuple[int, int, dict, int]:
    call = stub.EmbedStream(timeout=300)
    progress = {"sent": 0}

    async def write_all():
        for i in range(TOTAL):
            await call.write(pb.EmbedRequest(id=f"m{i}", texts=[BODY], truncate=pb.TRUNCATE_END, max_tokens=8))
            progress["sent"] = i + 1
        await call.done_writing()

    before = memory_mb(server.pid)["VmRSS"]
    reset_peak(server.pid)
    writer = asyncio.create_task(write_all())
    last, still_since = -1, time.monotonic()
    while time.monotonic() - still_since < 3.0 and not writer.done():  # until writes stop moving
        await asyncio.sleep(0.2)
        if progress["sent"] != last:
            last, still_since = progress["sent"], time.monotonic()
    sent_when_stalled = progress["sent"]
    # Others are still served while this stream is held back.
    other = pb_grpc.EmbedderStub(grpc.aio.insecure_channel(server.listen))
    reply = await other.Embed(pb.EmbedRequest(texts=["another client"]), timeout=10)
    assert vectors(reply).shape == (1, 384)
    peak_growth = memory_mb(server.pid)["VmHWM"] - before
    answers: dict[str, list] = {}
    async for response in call:  # now read: the rest is written and every message answered
        answers.setdefault(response.id, []).append(response)
    await writer
    return sent_when_stalled, peak_growth, answers, TOTAL


def test_stream_window_flag_and_variable():
    assert ServeConfig.from_args([], environ={}).max_stream_in_flight == 256
    assert ServeConfig.from_args([], environ={"POLLEN_MAX_STREAM_IN_FLIGHT": "8"}).max_stream_in_flight == 8
    with pytest.raises(ValueError, match="--max-stream-in-flight must be at least 1"):
        ServeConfig.from_args(["--max-stream-in-flight", "0"], environ={})
