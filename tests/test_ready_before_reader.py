"""A record a worker commits before its frontend has armed the response ring's wake-up is read.

The producer writes the eventfd only while the consumer says it sleeps, so a worker that is ready
(its READY record written) before the frontend sets that flag leaves no signal behind: the
frontend must look at the ring after arming, at start and after every worker restart, or the
server stays NOT_SERVING forever (server/pipeline/channel.py `attach`, shared_mem/ring.py
`sleep_unless_data`).
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from pollen.server.pipeline.channel import WorkerChannel
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring
from pollen.shared_mem.server_state import ServerState
from tests.conftest import ServerProcess
from tests.st_models import save_bpe_tokenizer

READY = json.dumps({"models": []}).encode()


def ready_rings() -> tuple[Ring, Ring]:
    """A worker's ring pair whose READY record is committed already, while no reader sleeps."""
    requests, responses = Ring.create(1 << 16), Ring.create(1 << 16)
    assert not responses.consumer_sleeping
    responses.write(records.READY, READY)  # no eventfd write: nobody said it sleeps
    return requests, responses


def test_a_worker_ready_before_the_frontend_arms_is_seen_at_start_and_after_a_restart():
    state = ServerState.create(frontends=1, workers=1)
    pairs = [ready_rings(), ready_rings()]

    async def scenario():
        channel = WorkerChannel(0, 0, state)
        channel.attach(*pairs[0])
        await asyncio.wait_for(channel.ready.wait(), 5)
        # The worker dies and its successor is ready before the frontend hears of it.
        channel.detach(requeue=True)
        assert not channel.ready.is_set()
        channel.attach(*pairs[1])
        await asyncio.wait_for(channel.ready.wait(), 5)
        channel.detach(requeue=False)

    try:
        asyncio.run(scenario())
    finally:
        for ring in (r for pair in pairs for r in pair):
            ring.close()
            ring.unlink()
        state.close()
        state.unlink()


def test_a_record_committed_just_before_the_flag_is_read_by_the_arming_reader():
    with Ring.create(1 << 12) as ring:
        try:
            assert not ring.sleep_unless_data() and ring.consumer_sleeping  # empty: sleep on the eventfd
            ring.set_consumer_sleeping(False)
            ring.write(records.READY, READY)  # the consumer is busy: no eventfd write
            assert ring.sleep_unless_data()  # so the reader that arms next must read it now
            kind, view = ring.read()
            assert (kind, bytes(view)) == (records.READY, READY)
            del view
            ring.release()
        finally:
            ring.unlink()


BUSY_LOOP = "while True: pass"


def tiny_causal_lm(path) -> str:
    """A 2-layer Qwen3ForCausalLM with a small byte-level BPE: about the smallest decoder pollen serves."""
    import transformers as tf

    vocab = save_bpe_tokenizer(path, template="$A <|endoftext|>")
    tf.Qwen3ForCausalLM(tf.Qwen3Config(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=48, max_position_embeddings=128)).save_pretrained(str(path))
    return str(path)


@pytest.mark.slow
def test_twenty_starts_in_a_row_on_busy_cores_each_become_healthy(tmp_path):
    """The defect showed on a 2-core machine whose cores other processes kept busy: the worker
    finished loading before the frontend attached its rings. Every start must reach SERVING."""
    model = tiny_causal_lm(tmp_path / "tiny-qwen3")
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(2)]
    try:
        for _ in range(20):
            server = ServerProcess("--model", model, "--frontends", "1", "--log-level", "WARNING")
            try:
                server.start(timeout=90)  # generous: the cores are busy; a lost READY never comes
                assert server.healthy()
                assert server.terminate() == 0
            finally:
                server.kill()  # only if it still runs (a failed start, a stop that hung)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
