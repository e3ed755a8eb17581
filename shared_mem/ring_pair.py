"""A ring pair: the request ring from one frontend to one worker and the response ring back, as
the supervisor hands it to both over their control sockets (common/control.py): the rings' names
in the message, their four eventfds beside it, in the order of `RingPair.fds`."""
from __future__ import annotations

import dataclasses

from pollen.shared_mem.ring import DEFAULT_WAIT_SLICE, Ring
from pollen.shared_mem.segment import unlink_segment


@dataclasses.dataclass(frozen=True, slots=True)
class RingPair:
    requests: str
    responses: str
    fds: tuple[int, ...] = ()  # request data, request space, response data, response space

    @classmethod
    def of(cls, requests: Ring, responses: Ring) -> RingPair:
        return cls(requests.name, responses.name,
                   (requests.data_fd, requests.space_fd, responses.data_fd, responses.space_fd))

    @classmethod
    def received(cls, body: dict, fds: list[int]) -> RingPair:
        return cls(body["requests"], body["responses"], tuple(fds))

    def names(self) -> dict[str, str]:  # as a control message carries them
        return {"requests": self.requests, "responses": self.responses}

    def attach(self, wait_slice: float = DEFAULT_WAIT_SLICE) -> tuple[Ring, Ring]:
        """(request ring, response ring), owning the fds; `wait_slice` is the request ring's."""
        return (Ring.attach(self.requests, *self.fds[:2], wait_slice=wait_slice),
                Ring.attach(self.responses, *self.fds[2:]))

    def unlink(self) -> None:
        for name in (self.requests, self.responses):
            unlink_segment(name)
