"""The worker's end of the control socket: a closed socket (the supervisor gone) stops the worker
with exit status 0 instead of a traceback, after the messages sent before the close."""
from __future__ import annotations

from collections import deque

import pytest

from pollen.common import control
from pollen.worker.loop import Worker


def test_a_closed_control_link_stops_the_worker_quietly():
    worker = object.__new__(Worker)  # only what poll_control touches: no model, no rings
    worker.control, supervisor = control.pair()
    worker.control.setblocking(False)
    worker.control_queue, worker.links = deque(), {}
    try:
        control.send(supervisor, {"kind": "stop"})
        worker.poll_control()
        assert [body["kind"] for body, _ in worker.control_queue] == ["stop"]
        worker.poll_control()  # nothing waiting, socket open: returns
        supervisor.close()
        with pytest.raises(SystemExit) as stopped:
            worker.poll_control()
        assert stopped.value.code == 0
    finally:
        worker.control.close()
