"""A ring pair handed to a child that is still starting, whose peer dies meanwhile: the supervisor
removes the pair's files at once, and the child maps them a moment later from the fds it was
given (shared_mem/ring_pair.py), then lets them go at the drop_link or worker_down that follows.
Nothing fails, nothing is logged as an error, and the server serves on."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, vectors


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.02)
    return value


def frontend_pids(srv: ServerProcess) -> list[int]:
    workers = set(srv.worker_pids())
    return [pid for pid in srv.child_pids() if pid not in workers]


def answered(srv: ServerProcess) -> bool:
    with grpc.insecure_channel(srv.listen) as channel:
        try:
            reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["still here"]), timeout=5)
        except grpc.RpcError:
            return False
    return vectors(reply).shape == (1, 384)


@pytest.mark.slow
def test_rings_whose_peer_died_before_the_child_mapped_them_are_no_error(tmp_path):
    log = tmp_path / "server.log"
    srv = ServerProcess(log=str(log)).start(timeout=60)
    try:
        # A worker still loading its model holds an add_link whose frontend dies now.
        (worker,) = srv.worker_pids()
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: [p for p in srv.worker_pids() if p != worker], 20, "the worker's restart")
        (frontend,) = frontend_pids(srv)
        os.kill(frontend, signal.SIGKILL)
        wait_for(lambda: answered(srv), 60, "answers after the worker's and the frontend's restarts")

        # A frontend still starting holds a worker_up whose worker dies now.
        (frontend,) = frontend_pids(srv)
        os.kill(frontend, signal.SIGKILL)
        wait_for(lambda: [p for p in frontend_pids(srv) if p != frontend], 20, "the frontend's restart")
        (worker,) = srv.worker_pids()
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: answered(srv), 60, "answers after the frontend's and the worker's restarts")

        text = log.read_text()
        assert "Traceback" not in text and "FileNotFoundError" not in text, text[-4000:]
        # Only the kills: no child died of the rings it was handed.
        assert text.count("worker 0 died") == 2 and text.count("frontend 0 died") == 2, text[-4000:]
        assert srv.terminate() == 0
    finally:
        srv.kill()
