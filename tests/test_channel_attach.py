"""A worker's READY that reaches the response ring before the frontend takes the ring pair: the
supervisor hands the pair to both at once, and a worker already loaded writes READY at once, while
the consumer's sleeping flag is still down, so it rings no bell. The channel reads what is there
when it attaches (server/channel.py), rather than wait for a wake-up that never comes."""
from __future__ import annotations

import asyncio
import json

from pollen.server.channel import WorkerChannel
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring
from pollen.shared_mem.server_state import ServerState


def test_a_ready_written_before_attach_is_read():
    state = ServerState.create(frontends=1, workers=1)
    requests, responses = Ring.create(1 << 16), Ring.create(1 << 16)
    ready = {"pid": 1, "index": 0, "models": [{"name": "m", "task": "embed", "memory_bytes": 1}]}
    try:
        assert not responses.consumer_sleeping
        responses.write(records.READY, json.dumps(ready).encode())  # no bell: nobody sleeps yet

        async def scenario() -> bool:
            channel = WorkerChannel(0, 0, state)
            channel.attach(requests, responses)
            try:
                await asyncio.wait_for(channel.ready.wait(), 5)
                return True
            except TimeoutError:
                return False
            finally:
                channel.detach(requeue=False)
        assert asyncio.run(scenario()), "the READY written before attach was never read"
    finally:
        for ring in (requests, responses):
            ring.unlink()
        state.close()
        state.unlink()
