"""What `pollen serve` does with the addresses it is told to listen on (server/process/address.py): it
removes only a stale socket at a unix path, never a file; and nobody who could not take an
address can keep pollen from it, while two pollen servers still never share one."""
from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from pollen.server.process.address import AddressInUse, claim
from tests.conftest import POLLEN, ServerProcess, free_port

NOBODY = 65534


def serve_briefly(*args: str, timeout: float = 30.0) -> tuple[int | None, str]:
    """`pollen serve ARGS`: its exit code and log, or None if it was still running (serving)
    after `timeout` s (then it is stopped)."""
    proc = subprocess.Popen([POLLEN, "serve", *args], stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, err


def test_a_regular_file_at_the_unix_path_is_refused_and_kept(tmp_path):
    path = tmp_path / "pollen.sock"
    path.write_text("an operator's file, not a socket\n")
    code, err = serve_briefly("--listen", f"unix:{path}", "--http-listen", f"127.0.0.1:{free_port()}")
    assert path.read_text() == "an operator's file, not a socket\n"
    assert code == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert f"{path} exists and is not a socket" in last, last
    assert "worker 0 started" not in err


def test_a_directory_or_a_symlink_at_the_unix_path_is_refused_and_kept(tmp_path):
    (tmp_path / "a-dir").mkdir()
    target = tmp_path / "target"
    target.write_text("kept")
    (tmp_path / "a-link").symlink_to(target)
    for name in ("a-dir", "a-link"):
        with pytest.raises(OSError, match=f"{tmp_path / name} exists and is not a socket"):
            claim(f"unix:{tmp_path / name}", "gRPC")
    assert (tmp_path / "a-dir").is_dir() and (tmp_path / "a-link").is_symlink() and target.read_text() == "kept"


def test_a_stale_socket_is_removed_and_served_on(tmp_path):
    path = tmp_path / "pollen.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # a socket file nobody listens on: what a killed server leaves
    srv = ServerProcess(listen=f"unix:{path}").start()
    try:
        assert srv.healthy()
    finally:
        assert srv.terminate() == 0


def squat(name: bytes) -> subprocess.Popen:
    """A process of user nobody holding the abstract unix socket `name` until killed."""
    code = ("import socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"s.bind({name!r})\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen(["python3", "-c", code], user=NOBODY, group=NOBODY, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def privileged_free_port() -> int:
    for port in range(900, 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port under 1024")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: starts a squatter as user nobody")
def test_another_user_cannot_keep_pollen_from_addresses_that_user_could_not_take(tmp_path):
    """User nobody holds the names pollen's abstract-socket locks had for a socket in a root-only
    directory and for a privileged port; pollen starts on both all the same."""
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    path = private / "pollen.sock"
    port = privileged_free_port()
    squatters = [squat(f"\0pollen-listen:unix:{path}".encode()), squat(f"\0pollen-listen:127.0.0.1:{port}".encode())]
    try:
        srv = ServerProcess(listen=f"unix:{path}", http_listen=f"127.0.0.1:{port}").start()
        try:
            assert srv.healthy()
            with socket.create_connection(("127.0.0.1", port), timeout=5) as http:
                http.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert http.recv(100).startswith(b"HTTP/1.1 200")
        finally:
            assert srv.terminate() == 0
    finally:
        for proc in squatters:
            proc.kill()
            proc.wait()


def test_one_claim_per_address_in_one_process_too(tmp_path):
    """The claims themselves exclude each other (a second pollen server makes the same calls),
    before anything listens: a unix path's lock file, a port's held bind."""
    first = claim(f"unix:{tmp_path}/pollen.sock", "gRPC")
    port = claim("127.0.0.1:0", "HTTP")
    try:
        with pytest.raises(AddressInUse, match="in use by another pollen server"):
            claim(f"unix:{tmp_path}/pollen.sock", "gRPC")
        with pytest.raises(AddressInUse, match="in use by another pollen server"):
            claim(port.address, "HTTP")
    finally:
        first.release()
        port.release()
    claim(f"unix:{tmp_path}/pollen.sock", "gRPC").release()  # free again once released
    claim(port.address, "HTTP").release()


def test_a_claimed_port_takes_the_frontends_and_refuses_everyone_else():
    held = claim("127.0.0.1:0", "gRPC")
    port = int(held.address.rpartition(":")[2])
    frontends = []
    try:
        # The frontends bind as gRPC and asyncio do: SO_REUSEADDR and SO_REUSEPORT.
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            frontends.append(s)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # answered by a frontend: the claim itself takes no connection
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with other, pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", port))
        for s in frontends:
            s.close()
        with socket.socket() as probe, pytest.raises(OSError):  # nobody listens: refused, not queued
            probe.settimeout(5)
            probe.connect(("127.0.0.1", port))
    finally:
        held.release()
        for s in frontends:
            s.close()


def test_a_port_in_time_wait_is_claimed():
    """A server that closed its connections first leaves them in TIME_WAIT on its port: a restart
    claims the port all the same."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server's side closes first: its end goes to TIME_WAIT
    time.sleep(0.1)
    client.close()
    server.close()
    claim(f"127.0.0.1:{port}", "gRPC").release()
