"""One huge request does not hold everyone else: a short query sent while a text of tens of
thousands of tokens (LONG_INPUT_CHUNK_MEAN windows) is being embedded is answered while the huge
request is still running, not after its last window. (How long it waits is a latency, which the
benchmarks measure: load/bench_mixed.py.)"""
from __future__ import annotations

import asyncio

import grpc

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc


def test_a_short_query_is_not_held_behind_a_huge_request(server):
    huge = " ".join(f"word{i % 5000}" for i in range(60_000))  # about 270 windows of 256 tokens

    async def main():
        async with grpc.aio.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            big = asyncio.ensure_future(stub.Embed(pb.EmbedRequest(texts=[huge], long_input=pb.LONG_INPUT_CHUNK_MEAN),
                                                   timeout=600))
            await asyncio.sleep(1.0)  # the huge request's windows are in the worker's queue
            query = await stub.Embed(pb.EmbedRequest(texts=["a short query"]), timeout=600)
            big_done_then = big.done()
            answer = await big
            return query, big_done_then, answer

    query, big_done_then, answer = asyncio.run(main())
    assert query.rows == 1 and answer.rows == 1
    assert answer.usage.prompt_tokens > 60_000
    # First come, first served, the query would be answered after the huge request's last window.
    assert not big_done_then, "the query was held until the huge request was done"
