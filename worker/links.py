"""The worker's side of its frontends: a `Link` is its end of one frontend's ring pair (a request
ring in, a response ring out), added and dropped by the supervisor over the control socket."""
from __future__ import annotations

import select

from pollen.shared_mem.ring import Ring
from pollen.shared_mem.ring_pair import RingPair

# An idle worker sleeps in long slices: a frontend re-signals a lost wake-up every few ms while
# it has requests out (server/pipeline/channel.py, tick), so a laptop stays quiet.
IDLE_SLICE = 0.5


class Link:
    """Frontend `frontend`'s rings, attached from the fds the supervisor handed over."""

    def __init__(self, frontend: int, requests: str, responses: str, fds: list[int]):
        self.frontend = frontend
        self.requests, self.responses = RingPair(requests, responses, tuple(fds)).attach(wait_slice=IDLE_SLICE)
        self.gone = False  # the supervisor said its frontend died; drop_link follows

    def close(self) -> None:
        self.requests.close()
        self.responses.close()


def wait_for_work(links: list[Link], control_fd: int, timeout: float) -> None:
    """Sleep until a request ring has data, the control socket has a message, or `timeout` s pass.

    Each request ring's consumer_sleeping flag is set before the rings are checked again, so a
    frontend that commits after the check writes the eventfd (the ring's sleep protocol).
    """
    poll = select.poll()
    poll.register(control_fd, select.POLLIN)
    for link in links:
        poll.register(link.requests.data_fd, select.POLLIN)
    try:
        if any([link.requests.sleep_unless_data() for link in links]):  # every ring armed, then looked at
            return
        poll.poll(min(timeout, IDLE_SLICE) * 1000)
    finally:
        for link in links:
            link.requests.set_consumer_sleeping(False)
            Ring.drain_signal(link.requests.data_fd)
