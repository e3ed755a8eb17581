"""Many concurrent bidirectional streams, every message in flight at once."""
from __future__ import annotations

import asyncio
import random

import grpc

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import cosine_rows, vectors
from tests.texts import stsb_pairs

STREAMS, MESSAGES = 8, 500


async def run_stream(target: str, stream: int, plan: list[list[int]], pool: list[str]) -> dict[str, list]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)

        async def requests():
            for i, picks in enumerate(plan):
                yield pb.EmbedRequest(id=f"s{stream}-m{i}", texts=[pool[j] for j in picks], normalize=True)

        answers: dict[str, list] = {}
        async for response in stub.EmbedStream(requests(), timeout=600):
            answers.setdefault(response.id, []).append(response)
        return answers


def test_eight_streams_of_500_messages(server, reference):
    rng = random.Random(11)
    pool = sorted({a for a, _, _ in stsb_pairs()})[:400]
    plans = [[rng.sample(range(len(pool)), rng.randint(1, 8)) for _ in range(MESSAGES)] for _ in range(STREAMS)]
    ref = reference(pool)

    async def main():
        return await asyncio.gather(*(run_stream(server.listen, s, plans[s], pool) for s in range(STREAMS)))

    results = asyncio.run(main())
    for s, answers in enumerate(results):
        assert len(answers) == MESSAGES, f"stream {s}: {len(answers)} distinct ids answered"
        for i, picks in enumerate(plans[s]):
            replies = answers[f"s{s}-m{i}"]
            assert len(replies) == 1, f"s{s}-m{i} answered {len(replies)} times"
            got = vectors(replies[0])
            assert got.shape == (len(picks), 384)
            assert cosine_rows(got, ref[picks]).min() >= 0.9999, f"s{s}-m{i} has wrong embeddings"
            assert replies[0].usage.prompt_tokens > len(picks)
