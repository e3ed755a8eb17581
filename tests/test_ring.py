"""Fast tests of shared_mem/ring.py: round trip, wrap, limits, held reservations, lifetime,
cross-process wake-up."""

import os
import secrets
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pollen.shared_mem.ring import CommitFirst, Ring
from pollen.shared_mem.segment import SHM_DIR, cleanup_stale_segments

PREFIX = "pollentest"


@pytest.fixture
def ring():
    r = Ring.create(4096, prefix=PREFIX)
    yield r
    r.close()
    r.unlink()


def drain(r):
    out = []
    while (rec := r.read()) is not None:
        out.append((rec[0], bytes(rec[1])))
    r.release()
    return out


def test_create_rounds_capacity_and_sets_limits(ring):
    assert ring.capacity == 4096
    assert ring.max_record == 4096 // 2 - Ring.RECORD_HEADER
    assert ring.free_bytes() == 4096
    assert os.path.getsize(os.path.join(SHM_DIR, ring.name)) == Ring.HEADER_BYTES + 4096
    with Ring.create(5000, prefix=PREFIX) as other:
        other.unlink()
        assert other.capacity == 8192


def test_round_trip_kinds_and_gather(ring):
    assert ring.read() is None and not ring.has_data()
    assert ring.try_write(7, b"hello")
    assert ring.try_write(0xFFFFFFFF, b"ab", bytearray(b"cd"), memoryview(b"ef"))
    assert ring.try_write(3)  # empty record
    vec = np.arange(5, dtype=np.float32)
    assert ring.try_write(4, vec)
    assert ring.has_data()
    got = drain(ring)
    assert got == [(7, b"hello"), (0xFFFFFFFF, b"abcdef"), (3, b""), (4, vec.tobytes())]
    assert ring.free_bytes() == ring.capacity and not ring.has_data()


def test_reserve_commit_and_views_stay_valid_until_release(ring):
    res = ring.try_reserve(3)
    res.view[:] = b"xyz"
    ring.commit(res, 9)
    ring.try_write(1, b"second")
    kind, first = ring.read()
    kind2, second = ring.read()
    assert (kind, bytes(first), kind2, bytes(second)) == (9, b"xyz", 1, b"second")
    assert ring.read() is None
    used = ring.capacity - ring.free_bytes()
    assert used == 2 * 16  # 8-byte header + payload padded to 8, per record
    ring.release()
    assert ring.free_bytes() == ring.capacity
    with pytest.raises(RuntimeError):
        ring.commit(res, 1)  # committed already


def test_wrap_around_keeps_records_whole(ring):
    rng = np.random.default_rng(1)
    sent = received = 0
    expected = []
    for round_ in range(200):
        n = int(rng.integers(0, 1500))
        payload = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        while not ring.try_write(round_, payload):
            for kind, data in drain(ring):
                assert (kind, data) == expected[received]
                received += 1
        expected.append((round_, payload))
        sent += 1
    for kind, data in drain(ring):
        assert (kind, data) == expected[received]
        received += 1
    assert received == sent == 200
    assert ring._wpos > 10 * ring.capacity  # it did wrap, many times


def test_record_exactly_max_record_at_every_kind_of_offset(ring):
    big = bytes(range(256)) * (ring.max_record // 256) + b"\x01" * (ring.max_record % 256)
    assert len(big) == ring.max_record
    for target in (0, 8, 2048 - 8, 2048, 2048 + 8, 4096 - 8):
        # Move the write offset to `target` with filler records (none of them wrapping) ...
        while (offset := ring._wpos % ring.capacity) != target:
            size = min((target - offset) % ring.capacity, 2048, ring.capacity - offset)
            assert ring.try_write(0, bytes(size - Ring.RECORD_HEADER))
            drain(ring)
        # ... then a max_record record fits there once the ring is drained, wrapping if it must.
        assert ring.try_write(1, big)
        assert drain(ring) == [(1, big)]


def test_full_ring_returns_none_then_succeeds_after_release(ring):
    n = 0
    while (res := ring.try_reserve(100)) is not None:
        ring.commit(res, n, notify=False)
        n += 1
    assert n == ring.capacity // 112
    assert ring.try_reserve(100) is None
    assert not ring.try_write(0, b"x" * 100)
    assert ring.read() is not None
    assert ring.try_reserve(100) is None  # read but not released: bytes still in use
    ring.release()
    assert ring.try_reserve(100) is not None


def test_value_error_above_max_record(ring):
    with pytest.raises(ValueError):
        ring.try_reserve(ring.max_record + 1)
    with pytest.raises(ValueError):
        ring.try_write(0, bytes(ring.max_record + 1))
    with pytest.raises(ValueError):
        ring.write(0, bytes(ring.max_record + 1), timeout=0.01)


def test_blocking_write_times_out_then_wakes_on_release(ring):
    while ring.try_write(0, bytes(1000)):
        pass
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        ring.write(0, bytes(1000), timeout=0.05)
    assert 0.04 < time.monotonic() - t0 < 1.0
    assert not ring.producer_sleeping

    def consume_later():
        time.sleep(0.05)
        drain(ring)

    t = threading.Thread(target=consume_later)
    t.start()
    ring.write(5, b"a" * 1000, timeout=5)  # does not fit until the thread drains the ring
    t.join()
    assert drain(ring) == [(5, b"a" * 1000)]


def test_records_publish_in_the_order_their_space_was_taken(ring):
    first = ring.try_reserve(10)
    second = ring.reserve(3)
    ring.write(7, b"plain")  # behind the open reservations: committed, not yet visible
    assert ring.read() is None
    assert ring.free_bytes() == ring.capacity - (24 + 16 + 16)  # open and unpublished space counts as used
    second.view[:] = b"two"
    ring.commit(second, 2)  # committed before `first`: waits behind it
    assert ring.read() is None
    first.view[:] = b"0123456789"  # filled after later records were placed
    third = ring.reserve(4)
    ring.commit(first, 1)  # publishes `first` and every committed record up to the open `third`
    assert drain(ring) == [(1, b"0123456789"), (2, b"two"), (7, b"plain")]
    ring.commit(third, 4)
    assert drain(ring) == [(4, bytes(4))]
    assert ring.free_bytes() == ring.capacity
    with pytest.raises(RuntimeError):
        ring.commit(second, 2)  # committed already


def test_reservations_wrap_and_fill_the_ring_exactly(ring):
    """Random sizes, up to three reservations open, written records between them; every byte and the
    order are checked while the ring wraps many times, and free_bytes stays exact."""
    rng = np.random.default_rng(7)
    held, expected, got = [], [], []
    in_use = 0  # bytes taken and not released, as the ring must count them
    for i in range(3000):
        n = int(rng.integers(0, 700))
        payload = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        before = ring._tail
        if rng.random() < 0.5:
            res = ring.try_reserve(n)
            ok = res is not None
            if ok:
                held.append((i, res, payload))
        else:
            ok = ring.try_write(i, payload)
        if ok:
            expected.append((i, payload))
            in_use += ring._tail - before  # header, padding and any skipped tail
        if not ok or len(held) > 3 or rng.random() < 0.3:
            # Commit the oldest reservation (or release what was read) and go on.
            if held:
                j, res, data = held.pop(0)
                res.view[:] = data
                ring.commit(res, j)
            while (rec := ring.read()) is not None:
                got.append((rec[0], bytes(rec[1])))
            released_to = ring._rcur
            in_use = ring._tail - released_to
            ring.release()
        assert ring.free_bytes() == ring.capacity - in_use
    for j, res, data in held:
        res.view[:] = data
        ring.commit(res, j)
    got += drain(ring)
    assert got == expected and len(got) > 1000
    assert ring._wpos > 20 * ring.capacity  # wrapped many times
    assert ring.free_bytes() == ring.capacity


def test_blocking_calls_refuse_to_wait_on_their_own_reservations(ring):
    held = ring.reserve(ring.max_record)  # half the ring, open
    ring.write(1, bytes(1000))
    assert drain(ring) == []  # nothing published: it all waits behind the reservation
    with pytest.raises(CommitFirst):
        ring.reserve(ring.max_record)
    with pytest.raises(CommitFirst):
        ring.write(2, bytes(1500), timeout=5)  # would wait forever: only our commit frees space
    small = ring.try_reserve(100)  # what does fit is still handed out
    assert small is not None
    ring.commit(small, 3)
    ring.commit(held, 4)
    assert [k for k, _ in drain(ring)] == [4, 1, 3]
    # Published but unread records are the consumer's to free: then the blocking calls wait.
    ring.write(5, bytes(ring.max_record))
    with pytest.raises(TimeoutError):
        ring.reserve(ring.max_record, timeout=0.05)
    drain(ring)
    assert ring.reserve(ring.max_record, timeout=0.05).nbytes == ring.max_record


def test_mapped_memory_is_the_segment_a_device_would_write(ring):
    """What a CUDA worker registers: the mapping's address and length. A write through the raw
    address (as a DMA would land) shows in the held record and reaches the consumer."""
    import ctypes

    address, length = ring.mapped_memory()
    assert length == Ring.HEADER_BYTES + ring.capacity
    held = ring.reserve(4)
    ctypes.memmove(address + Ring.HEADER_BYTES + held.offset + Ring.RECORD_HEADER, b"dma!", 4)
    assert bytes(held.view) == b"dma!"
    ring.commit(held, 6)
    assert drain(ring) == [(6, b"dma!")]


def test_segment_mode_is_0600_and_unlink_removes_it(ring):
    path = os.path.join(SHM_DIR, ring.name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert ring.name.startswith(f"{PREFIX}-{os.getpid()}-")
    ring.unlink()
    assert not os.path.exists(path)
    ring.unlink()  # idempotent
    ring.close()
    ring.close()


def test_attach_shares_data_and_rejects_foreign_files(ring):
    peer = Ring.attach(ring.name, ring.data_fd, ring.space_fd, own_fds=False)
    try:
        assert (peer.capacity, peer.max_record) == (ring.capacity, ring.max_record)
        ring.try_write(2, b"across")
        assert drain(peer) == [(2, b"across")]
        assert ring.free_bytes() == ring.capacity
    finally:
        peer.close()
    bogus = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(16)}"
    with open(os.path.join(SHM_DIR, bogus), "wb") as f:
        f.write(bytes(Ring.HEADER_BYTES + 4096))
    try:
        with pytest.raises(ValueError):
            Ring.attach(bogus, ring.data_fd, ring.space_fd, own_fds=False)
    finally:
        os.unlink(os.path.join(SHM_DIR, bogus))


def test_cleanup_stale_segments_removes_dead_pids_only():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{PREFIX}-{dead.pid}-{secrets.token_hex(16)}"
    open(os.path.join(SHM_DIR, stale), "wb").close()
    live = Ring.create(4096, prefix=PREFIX)  # our own pid: alive
    try:
        removed = cleanup_stale_segments(PREFIX)
        assert stale in removed and live.name not in removed
        assert not os.path.exists(os.path.join(SHM_DIR, stale))
        assert os.path.exists(os.path.join(SHM_DIR, live.name))
    finally:
        live.close()
        live.unlink()


# The child sleeps in wait_readable with a huge wait slice, so only the eventfd can wake it soon.
WAKE_CHILD = """
import sys, time
from pollen.shared_mem.ring import Ring
ring = Ring.attach(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), wait_slice=30.0)
print("ready", flush=True)
assert ring.wait_readable(timeout=20)
woke = time.monotonic()
kind, payload = ring.read()
print(kind, bytes(payload).decode(), repr(woke), flush=True)
"""


def test_eventfd_wakes_sleeping_consumer_in_other_process(ring):
    child = subprocess.Popen(
        [sys.executable, "-c", WAKE_CHILD, ring.name, str(ring.data_fd), str(ring.space_fd)],
        pass_fds=[ring.data_fd, ring.space_fd],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not ring.consumer_sleeping:
            assert time.monotonic() < deadline, "child never went to sleep"
            time.sleep(0.001)
        time.sleep(0.05)  # let it settle into poll()
        sent = time.monotonic()
        ring.try_write(42, b"wake")
        out, _ = child.communicate(timeout=10)
        kind, text, woke = out.split()
        assert (kind, text) == ("42", "wake")
        assert float(woke) - sent < 0.5  # the 30 s slice would be far later
        assert child.returncode == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
