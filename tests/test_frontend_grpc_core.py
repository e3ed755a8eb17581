"""The frontends run gRPC core on its iomgr path (server/grpc_api/grpc_core.py GRPC_CORE_ENV) unless the
user's environment sets GRPC_EXPERIMENTS itself, and every answer is right either way.

Seen from outside, in the real frontend processes while they answer real calls over TCP and a
unix socket: on the EventEngine path gRPC's `event_engine` threads read and write the sockets and
wake several times a call (counted as their context switches); on the iomgr path the poller
thread does that itself and those threads wake for the calls' deadline timers only."""
from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.test_frontends import frontend_pids

CALLS = 300


def event_engine_switches(pid: int) -> int:
    """Context switches of a process's gRPC EventEngine threads so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != "event_engine":
                    continue
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return total


def switches_per_call(users: str | None, listen: str | None = None) -> float:
    """The frontend's EventEngine threads' context switches per call, over CALLS calls on one connection."""
    server = ServerProcess("--log-level", "WARNING", listen=listen)
    server.env.pop("GRPC_EXPERIMENTS", None)
    if users is not None:
        server.env["GRPC_EXPERIMENTS"] = users
    server.start()
    try:
        pid = frontend_pids(server)[0]
        with grpc.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            request = pb.EmbedRequest(texts=["a sourdough starter"], normalize=True)
            one = stub.Embed(request, timeout=30)
            vector = np.frombuffer(one.embeddings, dtype=np.float32)
            assert vector.shape == (one.dims,) and abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
            before = event_engine_switches(pid)
            for _ in range(CALLS):
                assert stub.Embed(request, timeout=30).embeddings == one.embeddings
            return (event_engine_switches(pid) - before) / CALLS
    finally:
        server.kill()


@pytest.fixture(scope="module")
def on_grpcs_defaults() -> float:
    """The same figure with the user's GRPC_EXPERIMENTS empty: gRPC's own defaults (4-5 a call on
    the 2-core machine, against about 1 on the iomgr path: its timers still run there)."""
    return switches_per_call("")


def test_frontends_take_the_iomgr_path_by_default(on_grpcs_defaults):
    assert on_grpcs_defaults >= 2.0  # the EventEngine threads carry every call there
    assert switches_per_call(None) * 2 < on_grpcs_defaults


def test_frontends_take_the_iomgr_path_on_a_unix_socket(tmp_path, on_grpcs_defaults):
    assert switches_per_call(None, listen=f"unix:{tmp_path}/pollen.sock") * 2 < on_grpcs_defaults


def test_a_users_grpc_experiments_are_kept(on_grpcs_defaults):
    # The user's setting replaces ours whole: here the EventEngine comes back for every socket.
    assert switches_per_call("-event_engine_callback_cq") * 2 > on_grpcs_defaults
