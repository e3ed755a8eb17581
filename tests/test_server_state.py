"""The server state's worker lines (shared_mem/server_state.py): each worker's words are its own,
a second process sees what one stores, and clear_worker forgets all of one worker and nothing else."""
from __future__ import annotations

import multiprocessing

import numpy as np

from pollen.shared_mem.server_state import GRAPH_COUNTS, PHASES, ServerState


def store_counts(name: str, worker: int, values: list[int]) -> None:
    state = ServerState.attach(name)
    state.counts_view(worker)[:] = values
    state.beat(worker, 99)
    state.close()


def test_each_worker_keeps_its_own_words_and_another_process_sees_them():
    state = ServerState.create(frontends=3, workers=2)
    try:
        for w in range(2):
            state.phase_view(w)[:] = [10 * w + i for i in range(len(PHASES))]
            state.set_ready(w, True)
        # Another process stores worker 1's graph counts and batches, as a worker does.
        child = multiprocessing.get_context("spawn").Process(target=store_counts, args=(state.name, 1, [7, 8, 9]))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert state.counts_view(1).tolist() == [7, 8, 9] and len(GRAPH_COUNTS) == 3
        assert state.counts_view(0).tolist() == [0, 0, 0] and state.batches(1) == 99 and state.batches(0) == 0
        assert state.phase_view(1).tolist() == [10, 11, 12, 13] and state.phase_view(0).tolist() == [0, 1, 2, 3]
        # The frontends' rows come after the worker lines and do not overlap them.
        state.publish(2, 1, queued=5, backlog=6)
        assert state.queued_total() == 5 and state.backlog_total() == 6
        assert state.queued_by(2) == 5 and state.queued_by(1) == 0  # a frontend's row, over its workers
        assert state.counts_view(1).tolist() == [7, 8, 9]
        state.clear_worker(1)
        assert not state.ready(1) and state.batches(1) == 0 and state.heartbeat_ns(1) == 0
        assert not np.any(state.counts_view(1)) and not np.any(state.phase_view(1))
        assert state.ready(0) and state.phase_view(0).tolist() == [0, 1, 2, 3] and state.queued_total() == 5
    finally:
        state.close()
        state.unlink()
