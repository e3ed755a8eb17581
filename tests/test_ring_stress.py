"""Two-process ring stress test: 100,000 random-size records, random pauses, every byte checked.

The test process and a child (this file run as a script) share one 64 KiB ring, so records wrap
constantly. Record i is derived from (seed, i) alone: its size from the seed's plan, its bytes a
slice of a seeded random pool with i stamped into the first 8 bytes, its kind i & 0xffffffff.
Set POLLEN_RING_SEED to replay a failure; the seed is printed.

In the "held" variant the producer works as the worker does: it reserves some records' space
(up to three open at once), fills them later, writes records between them, and commits the open
reservations in any order (the oldest when only that frees room); the consumer must still see
record i, whole, at place i.

Child usage: python tests/test_ring_stress.py {produce|produce-held|consume} NAME DATA_FD SPACE_FD SEED
"""

import os
import secrets
import subprocess
import sys
import time
from collections import deque

import numpy as np
import pytest

from pollen.shared_mem.ring import CommitFirst, Ring

N_RECORDS = 100_000
CAPACITY = 64 * 1024
POOL = 1 << 20
TIME_LIMIT = 50.0  # seconds for the whole exchange; either side gives up after this
PAUSE_P = 1 / 1000  # chance of a 0..2 ms pause after a record, on each side


def plan(seed: int, max_record: int) -> tuple[np.ndarray, bytes]:
    """Sizes of all records (mostly small, some large, some at or near max_record), byte pool."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 257, N_RECORDS)
    r = rng.random(N_RECORDS)
    big = r < 0.10
    sizes[big] = rng.integers(257, 8193, big.sum())
    huge = r < 0.02
    sizes[huge] = rng.integers(8193, max_record + 1, huge.sum())
    near_max = r < 0.003
    sizes[near_max] = max_record - rng.integers(0, 24, near_max.sum())
    pool = rng.integers(0, 256, POOL + max_record, dtype=np.uint8).tobytes()
    return sizes, pool


def parts(i: int, size: int, pool: memoryview) -> tuple[bytes, memoryview]:
    """Record i as two pieces (so writes are gathered): an i stamp, then a slice of the pool."""
    k = min(8, size)
    start = (i * 7919) % POOL
    return i.to_bytes(8, "little")[:k], pool[start + k : start + size]


def pauser(seed: int):
    """A function that sleeps 0..2 ms with chance PAUSE_P (drawn 4096 at a time)."""
    rng = np.random.default_rng(seed)
    draws = iter(())

    def maybe_pause():
        nonlocal draws
        u = next(draws, None)
        if u is None:
            draws = iter(rng.random(4096).tolist())
            u = next(draws)
        if u < PAUSE_P:
            time.sleep(u / PAUSE_P * 0.002)

    return maybe_pause


def produce(ring: Ring, seed: int, peer_alive) -> None:
    sizes, pool = plan(seed, ring.max_record)
    pool, maybe_pause = memoryview(pool), pauser(seed + 1)
    deadline = time.monotonic() + TIME_LIMIT
    for i, size in enumerate(sizes.tolist()):
        # Every 5th record is committed quietly and announced with the next one: the batch path.
        quiet = i % 5 == 0
        while True:
            try:
                ring.write(i & 0xFFFFFFFF, *parts(i, size, pool), timeout=1.0, notify=not quiet)
                break
            except TimeoutError:
                assert peer_alive(), f"consumer died; producer at record {i}"
                assert time.monotonic() < deadline, f"producer stuck at record {i}"
        maybe_pause()
    ring.notify_consumer()


def produce_held(ring: Ring, seed: int, peer_alive) -> None:
    sizes, pool = plan(seed, ring.max_record)
    pool, maybe_pause = memoryview(pool), pauser(seed + 1)
    rng = np.random.default_rng(seed + 4)
    choices = iter(rng.random(4 * N_RECORDS).tolist())
    deadline = time.monotonic() + TIME_LIMIT
    held: deque = deque()  # (i, Reservation), oldest first

    def commit_one(at: int = 0):
        i, res = held[at]
        del held[at]
        stamp, rest = parts(i, int(sizes[i]), pool)
        res.view[: len(stamp)] = stamp
        res.view[len(stamp) :] = rest
        ring.commit(res, i & 0xFFFFFFFF)

    for i, size in enumerate(sizes.tolist()):
        hold_it = next(choices) < 0.3
        while True:
            try:
                if hold_it:
                    held.append((i, ring.reserve(size, timeout=1.0)))
                else:
                    ring.write(i & 0xFFFFFFFF, *parts(i, size, pool), timeout=1.0, notify=i % 5 != 0)
                break
            except CommitFirst:  # only our own open reservations are in the way
                commit_one(0)
            except TimeoutError:
                assert peer_alive(), f"consumer died; producer at record {i}"
                assert time.monotonic() < deadline, f"producer stuck at record {i}"
        while len(held) > 3 or (held and next(choices) < 0.3):
            commit_one(int(next(choices) * len(held)))  # any open one: publication stays in order
        maybe_pause()
    while held:
        commit_one(len(held) - 1)
    ring.notify_consumer()


PRODUCERS = {"produce": produce, "produce-held": produce_held}


def consume(ring: Ring, seed: int, peer_alive) -> None:
    sizes, pool = plan(seed, ring.max_record)
    pool, maybe_pause = memoryview(pool), pauser(seed + 2)
    batch_rng = np.random.default_rng(seed + 3)
    deadline = time.monotonic() + TIME_LIMIT
    i = 0
    while i < N_RECORDS:
        if not ring.wait_readable(timeout=1.0):
            assert peer_alive() or ring.has_data(), f"producer died; consumer at record {i}"
            assert time.monotonic() < deadline, f"consumer stuck at record {i}"
            continue
        for _ in range(int(batch_rng.integers(1, 9))):  # read several records per release
            record = ring.read()
            if record is None:
                break
            kind, payload = record
            stamp, rest = parts(i, int(sizes[i]), pool)
            if kind != i & 0xFFFFFFFF or len(payload) != sizes[i]:
                raise AssertionError(
                    f"record {i}: got kind {kind} length {len(payload)}, "
                    f"want kind {i & 0xFFFFFFFF} length {sizes[i]}"
                )
            if payload[: len(stamp)] != stamp or payload[len(stamp) :] != rest:
                raise AssertionError(f"record {i} (length {sizes[i]}): payload bytes differ")
            i += 1
        ring.release()
        maybe_pause()
    assert ring.read() is None, "records after the last one"


@pytest.mark.slow
@pytest.mark.parametrize("producer", ["produce", "produce-held"])
@pytest.mark.parametrize("child_role", ["consume", "produce"])
def test_two_process_stress(child_role, producer):
    seed = int(os.environ.get("POLLEN_RING_SEED") or secrets.randbelow(2**31))
    print(f"ring stress seed={seed}")
    ring = Ring.create(CAPACITY)
    child = None
    try:
        child = subprocess.Popen(
            [sys.executable, __file__, producer if child_role == "produce" else "consume", ring.name,
             str(ring.data_fd), str(ring.space_fd), str(seed)],
            pass_fds=[ring.data_fd, ring.space_fd],
            stderr=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        t0 = time.monotonic()
        run_parent = consume if child_role == "produce" else PRODUCERS[producer]
        try:
            run_parent(ring, seed, lambda: child.poll() is None)
            parent_error = None
        except AssertionError as exc:
            parent_error = exc
            child.kill()  # it may wait on us for TIME_LIMIT otherwise
        _, err = child.communicate(timeout=max(1.0, t0 + TIME_LIMIT + 5 - time.monotonic()))
        elapsed = time.monotonic() - t0
        assert parent_error is None, f"parent failed, seed={seed}: {parent_error}\nchild: {err}"
        assert child.returncode == 0, f"child ({child_role}) failed, seed={seed}:\n{err}"
        print(f"ring stress: {N_RECORDS} records, child {child_role}s ({producer}), {elapsed:.2f} s")
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        ring.close()
        ring.unlink()


def _child_main(role: str, name: str, data_fd: str, space_fd: str, seed: str) -> int:
    parent = os.getppid()
    ring = Ring.attach(name, int(data_fd), int(space_fd))
    try:
        (PRODUCERS.get(role, consume))(ring, int(seed), lambda: os.getppid() == parent)
    except AssertionError as exc:
        print(f"{role} failed: {exc}", file=sys.stderr)
        return 1
    finally:
        ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:]))
