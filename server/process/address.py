"""One server per address: claim the gRPC and HTTP addresses before any frontend binds them.

The frontends share each listening address on purpose (SO_REUSEPORT spreads the connections over
them), and gRPC sets SO_REUSEPORT by default, so a second `pollen serve` on the same port would
start quietly and take some of the connections; on a unix socket it would take the path over.
The supervisor therefore claims every address first and keeps the claim for its whole life, with
nothing that a user who could not take the address could hold in its way:

- a TCP port: the supervisor binds it itself and keeps that socket. The bind is made exclusive by
  listening (of two sockets bound with SO_REUSEADDR only one can listen, and no other process can
  bind beside a listener), then the socket stops listening but stays bound, with SO_REUSEADDR off
  and SO_REUSEPORT on: the kernel lets only this user's SO_REUSEPORT sockets (the frontends) bind
  beside it, and it takes no connection. A port in TIME_WAIT is free (SO_REUSEADDR at the bind).
- a unix path: an flock on `PATH.lock` beside it, a file of mode 0600 in the socket's directory:
  only a user who may create the socket there may create it, no other user may open it. Then a
  live socket at the path (a connect succeeds) belongs to another process; a socket nobody
  answers on is a leftover and is removed; anything that is not a socket is never touched.

The kernel drops both when the supervisor dies (kill -9 included); the lock file stays, and holds
nothing once its server is gone. Any failure refuses to start with one line naming the address.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from dataclasses import dataclass


class AddressInUse(OSError):
    """Another process listens on the address (or another pollen server holds it)."""


@dataclass
class Claim:
    address: str   # as the frontends should bind it (a port 0 resolved to a free port)
    lock: object   # the held socket (TCP) or the locked file (unix); closing it releases the claim

    def release(self) -> None:
        self.lock.close()


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def claim(address: str, what: str) -> Claim:
    """Claim `address` (gRPC's `host:port` or `unix:/path`, or HTTP's `host:port`) for this process."""
    if address.startswith("unix:"):
        path = os.path.abspath(address.removeprefix("unix:").removeprefix("//"))
        lock = _lock_file(path, address, what)
        try:
            _probe_unix(path, address, what)
        except BaseException:
            lock.close()
            raise
        return Claim(f"unix:{path}", lock)
    host, port = split_host_port(address)
    if port == 0:
        port = _free_port(host)
    resolved = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return Claim(resolved, _hold_port(host, port, address, what))


def _hold_port(host: str, port: int, address: str, what: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held = socket.socket(family, socket.SOCK_STREAM)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind((host, port))
        held.listen(0)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.shutdown(socket.SHUT_RD)  # on a listener: stop listening, stay bound
    except OSError as exc:
        held.close()
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUse(f"{what} address {address} is in use by {_owner(family, host, port)}") from None
        raise OSError(f"cannot listen on {what} address {address}: {exc.strerror}") from None
    return held


def _owner(family: int, host: str, port: int) -> str:
    """Who holds a port we could not bind: a bind with SO_REUSEPORT alone succeeds beside another
    pollen server of this user (its claim and its frontends), and beside nothing else."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return "another process"
    return "another pollen server"


def _lock_file(path: str, address: str, what: str):
    lock_path = path + ".lock"
    try:
        lock = open(lock_path, "ab", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW, 0o600))
    except OSError as exc:
        raise OSError(f"cannot use {what} address {address}: cannot open its lock file {lock_path}: "
                      f"{exc.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise AddressInUse(f"{what} address {address} is in use by another pollen server") from None
    return lock


def _probe_unix(path: str, address: str, what: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"cannot use {what} address {address}: {path} exists and is not a socket "
                      "(only a stale socket there is removed)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        try:
            os.unlink(path)  # a leftover of a server that is gone
        except FileNotFoundError:
            pass
        return
    except OSError as exc:
        raise OSError(f"cannot use {what} address {address}: {exc.strerror}") from None
    finally:
        probe.close()
    raise AddressInUse(f"{what} address {address} is in use by another process")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
