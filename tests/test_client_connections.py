"""client/connections.py on its own: how many channels, in what turn (no server: the channels are
made by a function that records what it was asked for; the real spread over a server's frontends
is tested in tests/test_frontends.py)."""
from __future__ import annotations

import pytest

from pollen.client.connections import MAX_CONNECTIONS, PER_FRONTEND, Connections


class RecordedChannel:
    """Stands in for a grpc channel: EmbedderStub only reads its unary_unary and friends."""

    def __init__(self, index: int):
        self.index = index

    def __getattr__(self, name):
        return lambda *args, **kwargs: (name, self.index)


def test_automatic_connections_start_at_one_and_follow_the_frontends():
    made = []
    conns = Connections(lambda i: made.append(i) or RecordedChannel(i))
    assert made == [0]
    conns.fit(5)
    assert made == list(range(PER_FRONTEND * 5))
    conns.fit(3)  # never fewer once open
    assert len(conns.pairs) == PER_FRONTEND * 5
    conns.fit(1000)
    assert len(conns.pairs) == MAX_CONNECTIONS
    conns.fit(0)  # a server too old to say: what it has stays
    assert len(conns.pairs) == MAX_CONNECTIONS


def test_a_given_count_is_opened_at_once_and_kept():
    conns = Connections(RecordedChannel, 3)
    assert [c.index for c in conns.channels] == [0, 1, 2]
    conns.fit(11)
    assert len(conns.pairs) == 3


def test_calls_take_the_connections_in_turn():
    conns = Connections(RecordedChannel, 3)
    assert [conns.next()[0].index for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("count", [-1, MAX_CONNECTIONS + 1])
def test_a_count_out_of_range_is_refused(count):
    with pytest.raises(ValueError, match="connections must be 0"):
        Connections(RecordedChannel, count)
