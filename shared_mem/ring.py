"""Lock-free single-producer single-consumer byte ring in POSIX shared memory.

One ``Ring`` carries records one way between two processes (the frontend has a request ring to the
worker and a response ring back). Records are variable-length byte strings tagged with a small
``kind``; nothing is pickled. A busy peer costs no system call per record: the eventfds are only
written when the other side has said it is asleep.

Setup: the creator calls ``Ring.create()``, starts the peer with
``subprocess.Popen(..., pass_fds=[ring.data_fd, ring.space_fd])`` and hands it ``ring.name`` and
the two fd numbers, which the peer passes to ``Ring.attach()``; or it hands all three fds, the
segment's ``ring.segment_fd`` too, over a unix socket (shared_mem/ring_pair.py), and the peer maps
the segment from that fd, so a segment the creator has removed meanwhile is still mapped. The
creator ``unlink()``s the segment when done; ``cleanup_stale_segments()`` (segment.py) at
start-up removes those of crashed creators.

An asyncio consumer does not block in ``wait_readable``; it watches ``data_fd``::

    def on_readable():
        ring.drain_signal(ring.data_fd)
        ring.set_consumer_sleeping(False)
        with ring.reading() as records:
            for kind, payload in records:
                handle(kind, payload)  # copy the payload out: it is reused once the block ends
        if ring.sleep_unless_data():   # committed between the last read and the flag
            loop.call_soon(on_readable)

    loop.add_reader(ring.data_fd, on_readable)
    if ring.sleep_unless_data():       # records committed before the flag wrote no eventfd
        on_readable()

Because a wake-up can (rarely) be lost, see ``Ring``, it should also call ``on_readable`` every
``ring.wait_slice`` or so while it awaits answers.

A producer writes a record in one call (``write``/``try_write``), or reserves its space first and
fills it later (the worker reserves a batch's answer when it launches the batch, and a second
batch's while the first still runs)::

    first = ring.reserve(n1)           # Reservation: first.view is the payload, writable
    second = ring.reserve(n2)          # placed after the first
    ring.write(RESULT, error_bytes)    # goes after both; committed now, published with them
    ring.commit(first, KIND)           # publishes `first`
    ring.commit(second, KIND)          # publishes `second`, then the RESULT record

Records are always published in the order their space was taken (see ``Ring``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import struct
import time
from collections import deque
from collections.abc import Iterator

import numpy as np

from pollen.shared_mem.segment import close_mapping, create_segment, map_segment, open_segment, unlink_segment

_MAGIC = int.from_bytes(b"POLLENRG", "little")
_VERSION = 1
_WRAP = 0xFFFFFFFF  # record length value meaning "no record here, continue at data offset 0"
_REC = struct.Struct("<II")  # record header: payload length, kind
_ONE = (1).to_bytes(8, "little")  # what an eventfd write adds to the counter
DEFAULT_WAIT_SLICE = 0.002  # seconds; the safety net for a lost wake-up (see Ring)

_STATIC = struct.Struct("<QI4xQ")  # magic, version, capacity: written once, before any sharing
# Element indices of the shared positions and flags in numpy views of the header (see Ring).
_I_WRITE_POS, _I_READ_POS = 8, 16  # u64 words at byte 64 and 128
_I_PRODUCER_SLEEPING, _I_CONSUMER_SLEEPING = 18, 34  # u32 words at byte 72 and 136


class CommitFirst(Exception):
    """The record cannot fit until the producer commits reservations it holds open.

    Raised by the blocking ``reserve``/``write`` instead of waiting: the consumer can only release
    published records, so waiting would wait forever.
    """


class Reservation:
    """Space for one record, taken in ring order, filled through ``view``, published by
    ``Ring.commit`` (once; in ring order: after every reservation taken before it)."""

    __slots__ = ("view", "offset", "nbytes", "end", "kind")

    def __init__(self, view: memoryview, offset: int, nbytes: int, end: int):
        self.view = view      # the payload, writable until committed
        self.offset = offset  # data offset of the record header
        self.nbytes = nbytes
        self.end = end        # write_pos once this record is published
        self.kind = -1        # set at commit; -1 while open


class Ring:
    """One-way record ring in a shared-memory segment, one producer process, one consumer process.

    Segment layout (little-endian; every field naturally aligned)::

        byte  size  field              written by
        ----  ----  -----------------  ---------------------------------------------------
           0     8  magic "POLLENRG"   create(), once             \\
           8     4  version            create(), once              | cache line 0: read-only
          16     8  capacity           create(), once              | after create()
          24    40  (zero)                                        /
          64     8  write_pos          producer                   \\ cache line 1:
          72     4  producer_sleeping  producer                    | producer-written
          76    52  (zero)                                        /
         128     8  read_pos           consumer                   \\ cache line 2:
         136     4  consumer_sleeping  consumer                    | consumer-written
         140    52  (zero)                                        /
         192  capacity  data area: records back to back

    ``write_pos`` and ``read_pos`` are byte counters that only grow (u64, they never wrap); a
    record at counter ``p`` lives at data offset ``p % capacity``. ``write_pos - read_pos`` is the
    number of bytes in use, so ``write_pos == read_pos`` means empty and nothing is ever ambiguous.

    Record format, every record starting 8-byte aligned::

        +------------+------------+---------------------------+---------+
        | length u32 | kind u32   | payload (length bytes)    | pad to 8|
        +------------+------------+---------------------------+---------+
        | 0xFFFFFFFF | (unused)   |  wrap marker: the rest of the data area is skipped and
        +------------+------------+  the next record starts at data offset 0

    A record is never split: if it does not fit before the end of the data area, the producer
    writes a wrap marker and places it at offset 0 (the skipped tail counts as used space). A
    record of at most ``capacity / 2`` bytes (header and padding included) fits at any offset once
    the ring drains (and the producer holds no reservation open), before the end or else at 0; a
    larger one might never fit. Hence ``max_record = capacity // 2 - RECORD_HEADER``.

    Reservations: the producer takes a record's space (``try_reserve``/``reserve``; ``write`` is a
    reservation filled and committed at once) at a private cursor, the *tail*, which runs ahead of
    ``write_pos`` while reservations are open. Space is taken in order, wrap markers included, and
    records are published in that same order: ``write_pos`` moves over a record only once it and
    every record before it are committed. So a record committed while an earlier one is open
    waits behind it. Free space counts the open reservations (``free_bytes``). Bytes between
    ``write_pos`` and the tail are the producer's alone: the consumer never looks past
    ``write_pos``.

    Publication order, and why it is safe:

    * Producer: payload and record header (and any wrap marker) first, then ``write_pos``. The
      consumer loads ``write_pos`` first and only then the records below it, so it never sees a
      record before its bytes are complete. With several reservations open, ``write_pos`` jumps
      over every record committed so far in one store, once the oldest open one is committed.
    * Consumer: reads (or copies out) the payloads, then publishes ``read_pos``. The producer loads
      ``read_pos`` before it writes into the space below it, so it never overwrites bytes the
      consumer still uses. The consumer may read several records and release them all at once.
    * Sleep protocol: a side about to block sets its ``*_sleeping`` flag, re-checks the ring, then
      polls its eventfd; the other side, after publishing its position, writes the eventfd only if
      the flag is set.
    * No waiting on oneself: the consumer can release only published records, so a producer that
      holds open reservations must not wait for space that only their commit would free. The
      blocking calls raise ``CommitFirst`` in that case rather than wait forever.

    Assumptions: x86-64 (TSO): stores become visible in program order, loads are not reordered with
    other loads nor with later stores, and an aligned 8-byte load or store is a single instruction
    (the positions are accessed through a numpy uint64 view for that reason, never struct). TSO
    does let a store be delayed past a later load, and Python has no memory fence, so in the sleep
    protocol "set flag, load position" on one side and "store position, load flag" on the other
    can both miss: a wake-up is lost. Blocking waits therefore poll in bounded slices of
    ``wait_slice`` seconds (a constructor argument), which caps the cost of that rare race at one
    slice.

    Capacity is rounded up to a multiple of 4096 bytes (the page size), at least 4096.
    """

    HEADER_BYTES = 192
    RECORD_HEADER = 8
    def __init__(self, name: str, mm: mmap.mmap, data_fd: int, space_fd: int, own_fds: bool,
                 wait_slice: float = DEFAULT_WAIT_SLICE, segment_fd: int = -1):
        self.name = name
        self.wait_slice = wait_slice  # seconds a blocking wait polls before looking again
        self.data_fd = data_fd
        self.space_fd = space_fd
        self.segment_fd = segment_fd  # the creator's, to hand over (-1 in a peer: mapped, closed)
        self._own_fds = own_fds
        self._mm = mm
        self._mv = memoryview(mm)
        self._u64 = np.frombuffer(mm, dtype=np.uint64, count=self.HEADER_BYTES // 8)
        self._u32 = np.frombuffer(mm, dtype=np.uint32, count=self.HEADER_BYTES // 4)
        self.capacity = _STATIC.unpack_from(mm)[2]
        self.max_record = self.capacity // 2 - self.RECORD_HEADER
        # Private cursors: each side owns one position and caches it here.
        self._wpos = int(self._u64[_I_WRITE_POS])  # producer: == shared write_pos
        self._tail = self._wpos  # producer: where the next reservation starts (>= _wpos)
        self._open: deque[Reservation] = deque()  # producer: not yet published, in ring order
        self._rcur = int(self._u64[_I_READ_POS])  # consumer: >= read_pos (read, not released)
        self._data_poll = select.poll()
        self._data_poll.register(data_fd, select.POLLIN)
        self._space_poll = select.poll()
        self._space_poll.register(space_fd, select.POLLIN)
        self._closed = False

    @classmethod
    def create(cls, capacity: int, prefix: str = "pollen", wait_slice: float = DEFAULT_WAIT_SLICE) -> Ring:
        """New segment of ``capacity`` data bytes (rounded up to 4096) with its two eventfds."""
        if capacity <= 0 or capacity > 2**32:
            raise ValueError(f"ring capacity must be in 1..2**32 bytes, got {capacity}")
        capacity = -(-capacity // 4096) * 4096
        name, mm = create_segment(cls.HEADER_BYTES + capacity, prefix)  # zero-filled: positions and flags are 0
        fds = []
        try:
            _STATIC.pack_into(mm, 0, _MAGIC, _VERSION, capacity)
            fds.append(open_segment(name))
            for _ in range(2):
                fds.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
        except BaseException:
            unlink_segment(name)
            mm.close()
            for efd in fds:
                os.close(efd)
            raise
        return cls(name, mm, fds[1], fds[2], own_fds=True, wait_slice=wait_slice, segment_fd=fds[0])

    @classmethod
    def attach(cls, name: str, data_fd: int, space_fd: int, own_fds: bool = True,
               wait_slice: float = DEFAULT_WAIT_SLICE, segment_fd: int = -1) -> Ring:
        """Map an existing segment, from ``segment_fd`` when given, else by basename, using
        eventfds inherited from its creator.

        With ``own_fds`` (the default, right for a child that got them through ``pass_fds`` or a
        unix socket), ``close()`` closes the two eventfds, and ``segment_fd`` is closed once mapped;
        pass False when they belong to another ``Ring`` object.
        """
        try:
            mm = map_segment(name, "ring", cls.HEADER_BYTES, fd=segment_fd if segment_fd >= 0 else None)
        finally:
            if own_fds and segment_fd >= 0:
                os.close(segment_fd)  # the mapping keeps the segment
        size = len(mm)
        magic, version, capacity = _STATIC.unpack_from(mm)
        if magic != _MAGIC or version != _VERSION or cls.HEADER_BYTES + capacity != size:
            mm.close()
            raise ValueError(f"{name} is not a pollen ring v{_VERSION}: magic={magic:#x} version={version} "
                             f"capacity={capacity} size={size}")
        return cls(name, mm, data_fd, space_fd, own_fds=own_fds, wait_slice=wait_slice)

    # --- producer side ---

    def free_bytes(self) -> int:
        """Bytes not in use now, the producer's open reservations included (a record also needs
        its header, padding, maybe a wrapped tail)."""
        in_use_to = max(self._tail, int(self._u64[_I_WRITE_POS]))  # a consumer's _tail is stale
        return self.capacity - (in_use_to - int(self._u64[_I_READ_POS]))

    def try_reserve(self, nbytes: int) -> Reservation | None:
        """Space for a record of ``nbytes``, placed after every reservation still open; None if the
        ring is full. Nothing is visible to the consumer until ``commit``."""
        return self._take(nbytes, int(self._u64[_I_READ_POS]))

    def reserve(self, nbytes: int, timeout: float | None = None) -> Reservation:
        """Blocking ``try_reserve``: TimeoutError after ``timeout`` s, and ``CommitFirst`` at once
        if only the commit of this producer's own open reservations could make room."""
        if (res := self.try_reserve(nbytes)) is not None:
            return res
        if self._place(nbytes, self._wpos) is None:
            # Even with every published record released there is no room: the rest is held by
            # our own open reservations, which the consumer cannot release.
            raise CommitFirst(f"ring {self.name}: a record of {nbytes} bytes fits only after the "
                              f"{len(self._open)} open reservations are committed")
        self.notify_consumer()  # records committed with notify=False must not wait on us
        deadline = None if timeout is None else time.monotonic() + timeout
        self._u32[_I_PRODUCER_SLEEPING] = 1
        try:
            # Re-check after setting the flag: the consumer may have released just before.
            while (res := self.try_reserve(nbytes)) is None:
                if not self._wait(self._space_poll, self.space_fd, deadline):
                    raise TimeoutError(f"ring {self.name}: no space for a record in {timeout} s")
            return res
        finally:
            self._u32[_I_PRODUCER_SLEEPING] = 0

    def commit(self, res: Reservation, kind: int, notify: bool = True) -> None:
        """Tag an open reservation ``kind`` (0..2**32-1) and publish it, now or, if reservations
        taken before it are still open, together with the last of them."""
        if not 0 <= kind <= 0xFFFFFFFF:
            raise ValueError(f"record kind must be in 0..2**32-1, got {kind}")
        if res.kind >= 0 or res not in self._open:
            raise RuntimeError("Ring.commit(): that reservation is committed already (or not this ring's)")
        res.kind = kind
        res.view = None
        _REC.pack_into(self._mm, self.HEADER_BYTES + res.offset, res.nbytes, kind)
        published = self._wpos
        while self._open and self._open[0].kind >= 0:
            published = self._open.popleft().end
        if published == self._wpos:
            return  # behind an open reservation: published with it
        self._u64[_I_WRITE_POS] = published  # publish last: the records are complete before this
        self._wpos = published
        if notify:
            self.notify_consumer()

    def try_write(self, kind: int, *parts, notify: bool = True) -> bool:
        """Gather-write the bytes-like ``parts`` as one record; False (nothing written) if full."""
        views = [memoryview(p).cast("B") for p in parts]
        res = self.try_reserve(sum(v.nbytes for v in views))
        if res is None:
            return False
        self._fill(res, views, kind, notify)
        return True

    def write(self, kind: int, *parts, timeout: float | None = None, notify: bool = True) -> None:
        """Blocking ``try_write`` (waits as ``reserve`` does)."""
        views = [memoryview(p).cast("B") for p in parts]
        self._fill(self.reserve(sum(v.nbytes for v in views), timeout), views, kind, notify)

    def _fill(self, res: Reservation, views: list[memoryview], kind: int, notify: bool) -> None:
        pos = 0
        for v in views:
            res.view[pos : pos + v.nbytes] = v
            pos += v.nbytes
        self.commit(res, kind, notify)

    def _take(self, nbytes: int, read_pos: int) -> Reservation | None:
        """Place a record at the tail if it fits with the consumer at ``read_pos``."""
        place = self._place(nbytes, read_pos)
        if place is None:
            return None
        offset, end, wraps = place
        if wraps:  # the skipped tail is ours until published, so the marker can go in now
            _REC.pack_into(self._mm, self.HEADER_BYTES + self._tail % self.capacity, _WRAP, 0)
        start = self.HEADER_BYTES + offset + self.RECORD_HEADER
        res = Reservation(self._mv[start : start + nbytes], offset, nbytes, end)
        self._open.append(res)
        self._tail = end
        return res

    def _place(self, nbytes: int, read_pos: int) -> tuple[int, int, bool] | None:
        """(data offset, tail after it, wraps) of a record of ``nbytes`` at the tail, or None."""
        if not 0 <= nbytes <= self.max_record:
            raise ValueError(f"record of {nbytes} bytes; this ring takes 0..{self.max_record}")
        size = self.RECORD_HEADER + ((nbytes + 7) & ~7)
        tail, cap = self._tail, self.capacity
        free = cap - (tail - read_pos)
        offset = tail % cap
        room = cap - offset  # >= 8: offsets are 8-aligned and capacity is a multiple of 8
        if size <= room:
            return (offset, tail + size, False) if size <= free else None
        # Does not fit before the end: a wrap marker, and the record at offset 0.
        return (0, tail + room + size, True) if room + size <= free else None

    @property
    def write_pos(self) -> int:
        """Producer: the byte counter up to which records are published."""
        return self._wpos

    @property
    def read_pos(self) -> int:
        """The byte counter up to which the consumer has released records (read from the segment)."""
        return int(self._u64[_I_READ_POS])

    def drop_published(self) -> None:
        """Producer, when the consumer is dead: free every published record unread, as the
        consumer would have, so that reservations find room again. Only for a ring whose consumer
        will never read again (its frontend died)."""
        self._u64[_I_READ_POS] = self._wpos

    def set_producer_sleeping(self, sleeping: bool) -> None:
        """Mark an event-loop producer as waiting for space (True) or not (False).

        While set, the consumer's ``release()`` writes ``space_fd``; watch it with add_reader.
        """
        self._u32[_I_PRODUCER_SLEEPING] = 1 if sleeping else 0

    @classmethod
    def max_record_for(cls, capacity: int) -> int:
        """The ``max_record`` a ring created with ``capacity`` will have."""
        return (-(-capacity // 4096) * 4096) // 2 - cls.RECORD_HEADER

    def mapped_memory(self) -> tuple[int, int]:
        """(address, length) of this process's mapping of the whole segment, header included:
        what a CUDA worker registers (cudaHostRegister) so device copies land in it directly."""
        return self._u64.__array_interface__["data"][0], len(self._mm)

    def notify_consumer(self) -> None:
        """Wake the consumer if it sleeps (after commits made with ``notify=False``)."""
        if self._u32[_I_CONSUMER_SLEEPING]:
            _signal(self.data_fd)

    # --- consumer side ---

    def has_data(self) -> bool:
        """True if a committed record follows the consumer's cursor."""
        return self._rcur != int(self._u64[_I_WRITE_POS])

    def read(self) -> tuple[int, memoryview] | None:
        """Next record as ``(kind, payload)``, or None when empty.

        The payload view is valid until ``release()``; copy what must outlive it.
        """
        cur = self._rcur
        if cur == int(self._u64[_I_WRITE_POS]):  # load write_pos before the record
            return None
        offset = cur % self.capacity
        nbytes, kind = _REC.unpack_from(self._mm, self.HEADER_BYTES + offset)
        if nbytes == _WRAP:  # committed together with the record at offset 0
            cur += self.capacity - offset
            offset = 0
            nbytes, kind = _REC.unpack_from(self._mm, self.HEADER_BYTES)
        if nbytes > self.max_record:
            raise RuntimeError(
                f"ring {self.name}: record of {nbytes} bytes at position {cur} exceeds max_record "
                f"{self.max_record}; the segment is corrupt. This is a bug."
            )
        self._rcur = cur + self.RECORD_HEADER + ((nbytes + 7) & ~7)
        start = self.HEADER_BYTES + offset + self.RECORD_HEADER
        return kind, self._mv[start : start + nbytes]

    @contextlib.contextmanager
    def reading(self) -> Iterator[Iterator[tuple[int, memoryview]]]:
        """The records committed so far, as ``(kind, payload)`` in order, all freed on leaving the
        block (``release``), whatever happens in it: copy out what must outlive it."""
        try:
            yield iter(self.read, None)
        finally:
            self.release()

    def release(self) -> None:
        """Free all records read so far (drop their views first); wake a waiting producer."""
        self._u64[_I_READ_POS] = self._rcur
        if self._u32[_I_PRODUCER_SLEEPING]:
            _signal(self.space_fd)

    def wait_readable(self, timeout: float | None) -> bool:
        """Block until a record is available or ``timeout`` s pass (None: forever); True if data.

        Sets ``consumer_sleeping`` while it waits, so the producer writes ``data_fd``. Polls in
        slices of at most ``wait_slice`` s because a wake-up can be lost (see the class docstring).
        """
        if self.has_data():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self._u32[_I_CONSUMER_SLEEPING] = 1
        try:
            while not self.has_data():  # re-check after setting the flag: no lost wake-up
                if not self._wait(self._data_poll, self.data_fd, deadline):
                    return False
            return True
        finally:
            self._u32[_I_CONSUMER_SLEEPING] = 0

    def _wait(self, poll: select.poll, fd: int, deadline: float | None) -> bool:
        """One slice of a blocking wait on eventfd ``fd``: False once ``deadline`` has passed."""
        wait = self.wait_slice
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            wait = min(wait, left)
        poll.poll(wait * 1000)
        self.drain_signal(fd)  # before the caller's re-check, so no signal is eaten
        return True

    def set_consumer_sleeping(self, sleeping: bool) -> None:
        """Mark an event-loop consumer idle (True) or busy (False); see the module docstring."""
        self._u32[_I_CONSUMER_SLEEPING] = 1 if sleeping else 0

    def sleep_unless_data(self) -> bool:
        """An event-loop consumer going idle: set ``consumer_sleeping``, then look again. True
        when a record is waiting, which the caller must read now: the producer committed it
        before it saw the flag and wrote no eventfd for it (a peer that was ready before this
        reader armed, say). The one place the consumer's side of the sleep protocol is kept."""
        self._u32[_I_CONSUMER_SLEEPING] = 1
        return self.has_data()

    @property
    def consumer_sleeping(self) -> bool:
        """Whether the consumer says it sleeps (the producer's test; handy in tests, metrics)."""
        return bool(self._u32[_I_CONSUMER_SLEEPING])

    @property
    def producer_sleeping(self) -> bool:
        """Whether the producer says it sleeps, waiting for space."""
        return bool(self._u32[_I_PRODUCER_SLEEPING])

    @staticmethod
    def drain_signal(fd: int) -> None:
        """Reset an eventfd's counter without blocking; no-op if it was not signalled."""
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            pass

    # --- lifetime ---

    def close(self) -> None:
        """Unmap and close owned fds; idempotent. The segment file stays (see ``unlink``).

        If payload views handed out are still alive, the mapping is freed when the last one goes.
        """
        if self._closed:
            return
        self._closed = True
        self._open.clear()
        self._u64 = self._u32 = None
        self._mv.release()
        close_mapping(self._mm)  # a view the caller still holds keeps it until that view goes
        if self._own_fds:
            for fd in (self.data_fd, self.space_fd, self.segment_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass  # -1 (a peer's), or already closed

    def unlink(self) -> None:
        """Remove the segment file; idempotent. Attached processes keep their mappings."""
        unlink_segment(self.name)

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signal(fd: int) -> None:
    try:
        os.write(fd, _ONE)
    except BlockingIOError:
        pass  # counter saturated: the peer has plenty of wake-ups pending already
