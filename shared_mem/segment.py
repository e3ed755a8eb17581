"""Named POSIX shared-memory segments under /dev/shm: how pollen names, creates, maps and removes
them. The rings (ring.py), the server state (server_state.py) and the metrics folder (server/cli.py)
all take their names from `segment_name`, so that `cleanup_stale_segments` finds whatever a
killed server left behind by the pid in the name.

A segment's pages are allocated when it is created (posix_fallocate). A tmpfs file is otherwise
sparse, each page taken when first written, and once /dev/shm is full (another program may fill
it at any time) the process that writes a page nobody has room for dies of SIGBUS. Allocated, a
segment that /dev/shm cannot hold is refused at creation (NoSpace), and one that was made is never
short of a page.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import shutil

SHM_DIR = "/dev/shm"
MIB = 1 << 20


class NoSpace(OSError):
    """SHM_DIR cannot hold a new segment; the message says how large, what is free, and what to do."""


def segment_name(prefix: str = "pollen") -> str:
    """`{prefix}-{pid}-{random}`: unique, and tells cleanup_stale_segments whose it is."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(16)}"


def create_segment(size: int, prefix: str = "pollen") -> tuple[str, mmap.mmap]:
    """A new zero-filled segment of `size` bytes, mode 0600, every page allocated, mapped; its
    name and mapping. NoSpace when SHM_DIR cannot hold it; the file is removed again if it cannot
    be allocated or mapped."""
    name = segment_name(prefix)
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            return name, mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)  # the mapping keeps the segment alive
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        fs = os.statvfs(SHM_DIR)
        free = fs.f_bavail * fs.f_frsize
        raise NoSpace(f"no space in {SHM_DIR} for a {size / MIB:.1f} MiB segment ({free / MIB:.1f} MiB free); give it "
                      "more shared memory (docker run --shm-size, or a memory emptyDir on /dev/shm in Kubernetes)"
                      ) from None


def open_segment(name: str) -> int:
    """An fd of segment `name` (O_CLOEXEC): a peer given a copy maps the segment from it
    (map_segment's `fd`), whether or not its file has been removed since."""
    return os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)


def map_segment(name: str, what: str, min_size: int, fd: int | None = None) -> mmap.mmap:
    """Map an existing segment whole: from `fd` (left open), or else by basename; ValueError if
    `name` is a path or the segment is smaller than `min_size` (then it is no pollen `what`)."""
    if "/" in name:
        raise ValueError(f"{what} name must be a basename under {SHM_DIR}, got {name!r}")
    own = fd is None
    if own:
        fd = open_segment(name)
    try:
        size = os.fstat(fd).st_size
        if size < min_size:
            raise ValueError(f"{name} is not a pollen {what}: {size} bytes")
        return mmap.mmap(fd, size)
    finally:
        if own:
            os.close(fd)


def close_mapping(mm: mmap.mmap) -> None:
    """Unmap now, or, while views into it are still alive, when the last one goes."""
    try:
        mm.close()
    except BufferError:
        pass


def unlink_segment(name: str) -> None:
    """Remove the segment's file; idempotent. Processes that mapped it keep their mappings."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def cleanup_stale_segments(prefix: str = "pollen") -> list[str]:
    """Remove ``/dev/shm/{prefix}-{pid}-*`` segments (and metrics folders) whose creator pid is
    gone; return their names. A reused pid keeps its stale segment until that process dies too:
    only a leak."""
    pattern = re.compile(re.escape(prefix) + r"-(\d+)-[0-9a-f]+")
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        match = pattern.fullmatch(name)
        if match is None or int(match.group(1)) <= 0:
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        path = os.path.join(SHM_DIR, name)
        try:
            if os.path.isdir(path):  # a metrics folder (server/cli.py)
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
