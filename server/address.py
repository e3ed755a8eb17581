"""One server per address: claim the gRPC and HTTP addresses before any frontend binds them.

The frontends share each listening address on purpose (SO_REUSEPORT spreads the connections over
them), and gRPC sets SO_REUSEPORT by default, so a second `pollen serve` on the same port would
start quietly and take some of the connections; on a unix socket it would take the path over.
The supervisor therefore claims every address first and keeps the claim for its whole life:

- a lock: an abstract unix socket named after the address, bound by the supervisor. Binding it
  is exclusive system-wide and the kernel drops it when the process dies (kill -9 included), so
  two pollen servers can never hold one address, and a crash leaves nothing behind;
- a probe for anything else: a TCP bind *without* SO_REUSEPORT fails while any socket listens on
  the port; for a unix path, a successful connect means a live server owns it (a path nobody
  answers on is a leftover and is removed).

Either failure refuses to start with "address in use", leaving the first server untouched.
"""
from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass


class AddressInUse(OSError):
    """Another process listens on the address (or another pollen server holds it)."""


@dataclass
class Claim:
    address: str   # as the frontends should bind it (a port 0 resolved to a free port)
    lock: socket.socket

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
        lock = _lock(f"unix:{path}", address, what)
        _probe_unix(path, address, what, lock)
        return Claim(f"unix:{path}", lock)
    host, port = split_host_port(address)
    if port == 0:
        port = _free_port(host)
    resolved = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lock = _lock(resolved, address, what)
    _probe_tcp(host, port, address, what, lock)
    return Claim(resolved, lock)


def _lock(key: str, address: str, what: str) -> socket.socket:
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind("\0pollen-listen:" + key)
    except OSError as exc:
        lock.close()
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUse(f"{what} address {address} is in use by another pollen server") from None
        raise
    return lock


def _probe_tcp(host: str, port: int, address: str, what: str, lock: socket.socket) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no owner
        probe.bind((host, port))
    except OSError as exc:
        lock.close()
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUse(f"{what} address {address} is in use by another process") from None
        raise OSError(f"cannot listen on {what} address {address}: {exc.strerror}") from None
    finally:
        probe.close()


def _probe_unix(path: str, address: str, what: str, lock: socket.socket) -> None:
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # a leftover of a server that is gone
        return
    except OSError as exc:
        lock.close()
        raise OSError(f"cannot use {what} address {address}: {exc.strerror}") from None
    finally:
        probe.close()
    lock.close()
    raise AddressInUse(f"{what} address {address} is in use by another process")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
