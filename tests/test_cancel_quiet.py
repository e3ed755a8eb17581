"""A client's cancel is not an error: streams cancelled mid-write (the server's answers blocked on
a client that reads none), cancelled while reading, and cut by a client killed mid-stream leave no
ERROR and no traceback in the server's log, and the server goes on answering."""
from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys

import grpc
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess

KILLED_CLIENT = """
import sys, grpc
from pollen.v1 import embedder_pb2 as pb, embedder_pb2_grpc as pb_grpc
stub = pb_grpc.EmbedderStub(grpc.insecure_channel(sys.argv[1]))
for answer in stub.EmbedStream(pb.EmbedRequest(id=str(i), texts=["a text"] * 16) for i in range(1 << 20)):
    print(answer.id, flush=True)
"""


async def cancel_streams(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        for _ in range(2):  # mid-write: 100 messages of answers nobody reads, then the cancel
            call = stub.EmbedStream()
            for i in range(100):
                await call.write(pb.EmbedRequest(id=str(i), texts=["a text to embed here"] * 64))
            await asyncio.sleep(1.0)
            call.cancel()
        for n in (5, 50):  # while reading
            call = stub.EmbedStream(pb.EmbedRequest(id=str(i), texts=["a text"] * 16) for i in range(10_000))
            async for answer in call:
                if int(answer.id) >= n:
                    call.cancel()
                    break
        reply = await stub.Embed(pb.EmbedRequest(texts=["still answered"]), timeout=30)
        assert reply.rows == 1


@pytest.mark.slow
def test_cancelled_and_cut_streams_log_no_error(tmp_path):
    log = tmp_path / "server.log"
    srv = ServerProcess(log=str(log)).start()
    try:
        for _ in range(2):
            client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, srv.listen], stdout=subprocess.PIPE,
                                      cwd=pathlib.Path(__file__).parent.parent)
            for _ in range(200):  # answers flowing, then the client dies mid-stream
                client.stdout.readline()
            client.kill()
            client.wait()
        asyncio.run(cancel_streams(srv.listen))
    finally:
        assert srv.terminate() == 0
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
