"""A ring pair: the request ring from one frontend to one worker and the response ring back, as
the supervisor hands it to both over their control sockets (common/control.py): the rings' names
in the message, and beside it each ring's segment fd and two eventfds, in the order of
`RingPair.fds`. A peer maps each segment from its fd, never by name: the supervisor removes a
pair's files as soon as either side dies, and a peer that maps them a moment later (a worker
still loading its model, a frontend still starting) maps them all the same; the drop_link or
worker_down that follows lets go of them."""
from __future__ import annotations

import dataclasses

from pollen.shared_mem.ring import DEFAULT_WAIT_SLICE, Ring
from pollen.shared_mem.segment import unlink_segment


@dataclasses.dataclass(frozen=True, slots=True)
class RingPair:
    requests: str
    responses: str
    # request segment, data, space; response segment, data, space
    fds: tuple[int, ...] = ()

    @classmethod
    def of(cls, requests: Ring, responses: Ring) -> RingPair:
        return cls(requests.name, responses.name,
                   tuple(fd for ring in (requests, responses) for fd in (ring.segment_fd, ring.data_fd, ring.space_fd)))

    @classmethod
    def received(cls, body: dict, fds: list[int]) -> RingPair:
        return cls(body["requests"], body["responses"], tuple(fds))

    def names(self) -> dict[str, str]:  # as a control message carries them
        return {"requests": self.requests, "responses": self.responses}

    def attach(self, wait_slice: float = DEFAULT_WAIT_SLICE) -> tuple[Ring, Ring]:
        """(request ring, response ring), owning the fds; `wait_slice` is the request ring's."""
        return (Ring.attach(self.requests, *self.fds[1:3], segment_fd=self.fds[0], wait_slice=wait_slice),
                Ring.attach(self.responses, *self.fds[4:6], segment_fd=self.fds[3]))

    def unlink(self) -> None:
        for name in (self.requests, self.responses):
            unlink_segment(name)
