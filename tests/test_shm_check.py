"""`pollen serve` refuses to start when /dev/shm cannot hold its rings (server/process/app.py, check_shm),
instead of dying of SIGBUS later, when a ring page is first written."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from pollen.server import config
from pollen.server.config import ServeConfig
from pollen.server.process.app import SHM_METRICS_PER_PROCESS, check_shm, shm_need, worker_rings_need
from pollen.shared_mem.ring import Ring
from pollen.shared_mem.segment import SHM_DIR
from pollen.shared_mem.server_state import ServerState
from tests.conftest import POLLEN, free_port

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def test_the_default_cpu_server_needs_26_mib():
    # 1 frontend x 1 worker x (8 MiB request ring + 16 MiB response ring, a header page each),
    # one page of server state, 1 MiB of metrics files for the supervisor and for the frontend.
    cfg = ServeConfig(response_ring_bytes=16 * MIB)  # what check_limits sizes for all-MiniLM-L6-v2
    assert shm_need(cfg) == (8 * MIB + PAGE) + (16 * MIB + PAGE) + PAGE + 2 * MIB


def test_the_need_is_what_the_segments_take_in_tmpfs():
    """The rings and the server state, created for real, take the pages shm_need counts."""
    cfg = ServeConfig(frontends=2, workers=3, request_ring_bytes=5000, response_ring_bytes=70_000)
    segments = [ServerState.create(2, 3).name]
    try:
        for _ in range(2 * 3):
            for capacity in (5000, 70_000):
                ring = Ring.create(capacity)
                segments.append(ring.name)
                ring.close()
        sizes = [os.stat(os.path.join(SHM_DIR, name)).st_size for name in segments]
    finally:
        for name in segments:
            os.unlink(os.path.join(SHM_DIR, name))
    pages = sum(-(-size // PAGE) * PAGE for size in sizes)
    assert pages == shm_need(cfg) - 3 * SHM_METRICS_PER_PROCESS
    assert shm_need(cfg) == 6 * (3 * PAGE + 19 * PAGE) + PAGE + 3 * MIB  # 5000 -> 2 pages, 70,000 -> 18


def automatic_config(monkeypatch, frontends: int, **flags) -> ServeConfig:
    """A config whose --frontends was left at 0, on a machine whose cores call for `frontends`
    (a GPU host's count; on the CPU pollen's own choice is 1)."""
    monkeypatch.setattr(config, "default_frontends", lambda device, workers: frontends)
    return ServeConfig(response_ring_bytes=16 * MIB, **flags)


def test_an_automatic_frontend_count_is_lowered_to_what_dev_shm_holds_and_the_log_says_so(monkeypatch, caplog):
    cfg = automatic_config(monkeypatch, 6)
    assert cfg.frontends == 6 and cfg.frontends_automatic
    three = automatic_config(monkeypatch, 3)
    free = shm_need(three) + worker_rings_need(three) + MIB  # three frontends and a worker restart, not four
    assert shm_need(automatic_config(monkeypatch, 4)) <= free  # four would start, with no room for a restart
    with caplog.at_level("WARNING", logger="pollen"):
        check_shm(cfg, free)
    assert cfg.frontends == 3
    assert "too little for the 6 frontends" in caplog.text and "starting 3" in caplog.text
    assert "--shm-size" in caplog.text
    child = ServeConfig(**cfg.to_dict())  # what a frontend or worker gets: the lowered count, fixed
    assert child.frontends == 3 and not child.frontends_automatic and "frontends_automatic" not in cfg.to_dict()


def test_a_frontend_count_the_user_set_is_refused_rather_than_lowered(monkeypatch):
    cfg = ServeConfig(response_ring_bytes=16 * MIB, frontends=6)
    assert not cfg.frontends_automatic
    with pytest.raises(ValueError, match=r"6 frontend\(s\) x 1 worker\(s\)"):
        check_shm(cfg, shm_need(automatic_config(monkeypatch, 3)))
    assert cfg.frontends == 6


def test_one_frontend_starts_where_it_fits_without_the_room_for_a_worker_restart(monkeypatch):
    cfg = automatic_config(monkeypatch, 6)
    check_shm(cfg, shm_need(automatic_config(monkeypatch, 1)))
    assert cfg.frontends == 1


def test_an_automatic_count_that_not_even_one_frontend_fits_is_refused_naming_that_count(monkeypatch):
    cfg = automatic_config(monkeypatch, 6)
    with pytest.raises(ValueError, match=r"6 frontend\(s\) x 1 worker\(s\)"):
        check_shm(cfg, shm_need(automatic_config(monkeypatch, 1)) - PAGE)
    assert cfg.frontends == 6


def test_bge_m3_s_grown_ring_falls_back_before_any_frontend_is_lowered_and_the_log_says_so(caplog):
    """A laptop's Docker /dev/shm (64 MiB) cannot hold BGE-M3's 129 MiB ring; it still serves, with
    the ring any model gets, and the log names the trade."""
    cfg = ServeConfig(response_ring_bytes=129 * MIB)
    cfg.response_ring_floor = 16 * MIB  # what check_limits sets for BGE-M3's automatic ring
    with caplog.at_level("WARNING", logger="pollen"):
        check_shm(cfg, 64 * MIB)
    assert (cfg.response_ring_bytes, cfg.response_ring_floor, cfg.frontends) == (16 * MIB, 0, 1)
    assert "BGE-M3's automatic 129 MiB response rings" in caplog.text and "using 16 MiB rings" in caplog.text
    roomy = ServeConfig(response_ring_bytes=129 * MIB)
    roomy.response_ring_floor = 16 * MIB
    check_shm(roomy, shm_need(roomy))
    assert roomy.response_ring_bytes == 129 * MIB  # where it fits, it stays


def test_enough_dev_shm_changes_nothing(monkeypatch):
    cfg = automatic_config(monkeypatch, 6)
    check_shm(cfg, shm_need(cfg))
    assert cfg.frontends == 6


def test_a_server_that_dev_shm_cannot_hold_exits_1_at_start_saying_why():
    """Request rings of 4 GiB (the most a ring may have) for more workers than /dev/shm can hold,
    by at least a ring more (other servers on this machine may free some meanwhile)."""
    fs = os.statvfs(SHM_DIR)
    free = fs.f_bavail * fs.f_frsize
    workers = free // (4 << 30) + 2
    proc = subprocess.Popen(
        [POLLEN, "serve", "--listen", f"127.0.0.1:{free_port()}", "--http-listen", f"127.0.0.1:{free_port()}",
         "--workers", str(workers), "--request-ring-bytes", str(4 << 30)],
        stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert f"{SHM_DIR} has " in stderr and "MiB free but this server needs" in stderr
    assert f"1 frontend(s) x {workers} worker(s) x (4096.0 MiB request ring" in stderr
    assert "--shm-size" in stderr and "worker 0 started" not in stderr
    # Refused before any segment was made (its metrics folder, made first, is gone too).
    assert not [name for name in os.listdir(SHM_DIR) if name.startswith(f"pollen-{proc.pid}-")]


def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt"], check=False, capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs `unshare -m` and mount (root) for a small /dev/shm")
def test_every_default_is_refused_in_a_16_mib_dev_shm_as_docker_run_shm_size_16m_gives():
    """A private mount namespace with a 16 MiB tmpfs on /dev/shm, as a container started with
    --shm-size=16m sees it; the default CPU server needs 26 MiB."""
    serve = (f"{POLLEN} serve --listen 127.0.0.1:{free_port()} --http-listen 127.0.0.1:{free_port()}")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f"mount -t tmpfs -o size=16m tmpfs {SHM_DIR} && exec {serve}"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"{SHM_DIR} has 16.0 MiB free but this server needs 26.0 MiB there" in done.stderr
