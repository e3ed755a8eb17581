"""/dev/shm filling up after the start (another program taking it) costs pollen no process: every
segment's pages are allocated when it is made (shared_mem/segment.py), so a server that started
keeps serving, and a restart /dev/shm cannot hold is refused in one log line and tried again,
instead of a SIGBUS in whatever process first writes a ring page nobody has room for."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest

import tests.conftest
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import POLLEN, ServerProcess, vectors
from tests.test_shm_check import can_mount_tmpfs

MIB = 1 << 20
SHM_MIB = 16  # the server's private /dev/shm: its ~3 MiB of segments and room to spare
RING = 256 << 10  # each ring's capacity: small, so that a few answers go through all its pages
HEADROOM = 64 << 10  # what the filler leaves free: less than a ring, room for the metrics files
TEXTS = 16  # per request: each answer takes 16 x 384 float32 of the response ring


def small_shm_pollen(tmp_path) -> str:
    """A `pollen` that runs in a private mount namespace with a SHM_MIB tmpfs on /dev/shm, as a
    container with --shm-size sees it; the server's pid is this script's (each step execs)."""
    script = tmp_path / "pollen-small-shm"
    script.write_text("#!/bin/sh\n"
                      "exec unshare -m --propagation private sh -c "
                      f"'mount -t tmpfs -o size={SHM_MIB}m tmpfs /dev/shm && exec \"$0\" \"$@\"' {POLLEN} \"$@\"\n")
    script.chmod(0o755)
    return str(script)


class Filler:
    """Takes /dev/shm (the server's, through /proc/PID/root) down to HEADROOM free, now and, with
    `keep()`, every 20 ms until `stop()`: another program that grabs whatever is freed."""

    def __init__(self, shm: str):
        self.shm = shm
        self.files: list[str] = []
        self.stopping = threading.Event()
        self.thread = None

    def free(self) -> int:
        fs = os.statvfs(self.shm)
        return fs.f_bavail * fs.f_frsize

    def fill(self) -> None:
        while (take := self.free() - HEADROOM) >= 4096:
            path = os.path.join(self.shm, f"filler-{len(self.files)}")
            self.files.append(path)
            with open(path, "wb") as f:
                try:
                    f.write(b"\1" * (take // 4096 * 4096))
                except OSError:
                    pass

    def keep(self) -> None:
        def run():
            while not self.stopping.wait(0.02):
                self.fill()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread:
            self.thread.join()
        for path in self.files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # the server is gone, and its /dev/shm with it
        self.files.clear()


def embed_many(target: str, requests: int) -> list:
    async def main():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            return await asyncio.gather(*(
                stub.Embed(pb.EmbedRequest(texts=[f"text {r} {i}" for i in range(TEXTS)]), timeout=60)
                for r in range(requests)), return_exceptions=True)

    return asyncio.run(main())


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.1)
    return value


@pytest.mark.slow
@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs `unshare -m` and mount (root) for a small /dev/shm")
def test_a_full_dev_shm_after_the_start_kills_nothing_and_a_restart_waits_for_room(tmp_path, monkeypatch):
    monkeypatch.setattr(tests.conftest, "POLLEN", small_shm_pollen(tmp_path))
    log = tmp_path / "server.log"
    srv = ServerProcess("--request-ring-bytes", str(RING), "--response-ring-bytes", str(RING),
                        "--max-texts-per-request", str(TEXTS), log=str(log)).start(timeout=90)
    filler = Filler(f"/proc/{srv.pid}/root/dev/shm")
    try:
        assert filler.free() > 4 * MIB  # the server's own small /dev/shm, with room left after its start
        filler.fill()
        # 16 answers of 24 KiB each go through every page of the response ring.
        replies = embed_many(srv.listen, 16)
        errors = [r for r in replies if isinstance(r, Exception)]
        assert not errors, errors[:3]
        assert all(vectors(r).shape == (TEXTS, 384) for r in replies)
        assert "died" not in log.read_text(), log.read_text()[-3000:]

        # A worker restart while another program takes every byte freed: refused, said, retried.
        filler.keep()
        # The server's segments are held open here, so the pages the dead worker's rings free stay
        # taken whatever the order in which the supervisor and the frontend let go of them and the
        # supervisor asks for new ones (a ready worker is restarted at once: the filler alone would
        # race it). They are let go once the refusals are seen, and the filler takes their room.
        held = [os.open(os.path.join(filler.shm, name), os.O_RDONLY) for name in os.listdir(filler.shm)
                if name.startswith("pollen-") and os.path.isfile(os.path.join(filler.shm, name))]
        (worker,) = srv.worker_pids()
        os.kill(worker, signal.SIGKILL)
        try:
            wait_for(lambda: log.read_text().count("cannot be restarted") >= 2, 40, "two refused restarts")
        finally:
            for fd in held:
                os.close(fd)
        refused = [line for line in log.read_text().splitlines() if "cannot be restarted" in line]
        assert "worker 0 cannot be restarted: no space in /dev/shm for a 0.3 MiB segment" in refused[0], refused
        assert "--shm-size" in refused[0] and "trying again in" in refused[0]
        assert srv.worker_pids() == []  # nothing started that could not have its rings

        filler.stop()  # room again: the next try starts it
        wait_for(srv.worker_pids, 40, "the worker's restart")
        replies = wait_for(lambda: (r := embed_many(srv.listen, 2)) and not any(isinstance(x, Exception) for x in r)
                           and r, 60, "answers from the restarted worker")
        assert all(vectors(r).shape == (TEXTS, 384) for r in replies)
        text = log.read_text()
        assert "code -7" not in text and "Traceback" not in text, text[-3000:]
        assert text.count("worker 0 died") == 1
        assert srv.terminate() == 0
    finally:
        filler.stop()
        srv.kill()
