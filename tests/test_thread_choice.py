"""The CPU engine's thread count per batch (worker/thread_choice.py): the count whose recent
batches ran faster (small batches by their seconds, large ones per token, learned apart), the
other one probed every PROBE_EVERY batches of the class; and the flag that turns it off, carried
to the worker."""
from __future__ import annotations

from pollen.worker.thread_choice import LEARN_TOKENS, PROBE_EVERY, SMALL_MIN_SPEEDUP, ThreadChoice


def drive(choice: ThreadChoice, seconds_per_token: dict[int, float], batches: int, tokens: int = 1024) -> list[int]:
    used = []
    for _ in range(batches):
        count = choice.threads_for(tokens)
        used.append(count)
        choice.ran(count, tokens, seconds_per_token[count] * tokens)
    return used


def test_busy_cores_move_batches_to_one_thread_and_back():
    choice = ThreadChoice(2)
    quiet = drive(choice, {2: 1.0, 1: 1.7}, 100)
    assert quiet[:2] == [2, 1]  # each count measured once first
    assert abs(quiet[2:].count(1) - len(quiet[2:]) / PROBE_EVERY) <= 1  # then only the probes
    busy = drive(choice, {2: 5.0, 1: 2.0}, 100)
    assert busy[:3] == [2, 2, 1]  # two slow batches confirm the step, then the count that now wins
    assert busy[2:].count(2) <= len(busy) // PROBE_EVERY + 1
    assert drive(choice, {2: 1.0, 1: 1.7}, PROBE_EVERY + 3)[-1] == 2  # found again by a probe


def test_small_and_large_batches_learn_apart():
    choice = ThreadChoice(2)
    drive(choice, {2: 5.0, 1: 2.0}, 4)  # docs: one thread is faster
    assert choice.large.current == 1
    small = drive(choice, {2: 0.1, 1: 99.0}, 50, tokens=LEARN_TOKENS - 1)  # queries: two are
    assert small[:2] == [2, 1] and small[2:].count(1) <= len(small) // PROBE_EVERY + 1
    assert choice.small.current == 2 and choice.large.current == 1


def test_a_query_figure_is_its_batch_seconds():
    choice = ThreadChoice(2)
    choice.ran(2, 10, 0.004)
    choice.ran(1, 200, 0.005)
    assert choice.small.cost == {2: 0.004, 1: 0.005}


def test_off_or_one_thread_never_changes_the_count():
    assert set(drive(ThreadChoice(2, adapt=False), {2: 9.0, 1: 1.0}, 60)) == {2}
    assert set(drive(ThreadChoice(1), {1: 1.0}, 10)) == {1}


def test_the_flag_reaches_the_worker_config():
    from pollen.common.worker_config import WorkerConfig
    from pollen.server.config import ServeConfig

    for args, want in (([], True), (["--adapt-worker-threads", "off"], False)):
        cfg = ServeConfig.from_args(["--max-batch-tokens", "8192", *args], environ={})
        worker = WorkerConfig.of(cfg, 0, control_fd=3, state="s", cpu_cores=[])
        assert worker.adapt_worker_threads is want


def test_a_step_in_load_switches_after_two_batches_and_a_hiccup_does_not():
    choice = ThreadChoice(2)
    drive(choice, {2: 1.0, 1: 1.5}, 10)
    assert choice.large.current == 2
    assert drive(choice, {2: 4.0, 1: 2.0}, 3) == [2, 2, 1]  # 4x its average twice: replaced
    choice = ThreadChoice(2)
    drive(choice, {2: 1.0, 1: 1.5}, 10)
    assert drive(choice, {2: 1.8, 1: 1.5}, 2) == [2, 2]  # under STEP: averaged, no switch yet
    choice = ThreadChoice(2)
    drive(choice, {2: 1.0, 1: 1.5}, 10)
    drive(choice, {2: 9.0, 1: 1.5}, 1)  # one hiccup: left out of the average
    assert drive(choice, {2: 1.0, 1: 1.5}, 3) == [2, 2, 2] and choice.large.cost[2] == 1.0


def test_a_step_seen_by_queries_moves_docs_too():
    choice = ThreadChoice(2)
    drive(choice, {2: 1.0, 1: 1.5}, 10)  # docs, quiet: two threads
    drive(choice, {2: 1.0, 1: 2.0}, 10, tokens=10)  # queries, quiet: two threads (twice as fast)
    assert choice.small.current == choice.large.current == 2
    assert drive(choice, {2: 5.0, 1: 2.0}, 3, tokens=10) == [2, 2, 1]  # queries see the step
    assert choice.large.current == 1  # docs scaled by it: their first batch runs on one thread
    docs = drive(choice, {2: 5.0, 1: 2.0}, PROBE_EVERY // 4 + 2)
    assert docs[0] == 1 and docs.count(2) == 1  # and probe two threads soon, to check


def test_a_query_takes_the_pool_only_where_it_buys_enough_speed():
    """Docs take the faster count; a query takes more threads only when they make it at least
    SMALL_MIN_SPEEDUP times faster (on two cores two threads cost a query half again its CPU
    for a quarter less time)."""
    slight = {2: 1.0, 1: 0.9 * SMALL_MIN_SPEEDUP}
    choice = ThreadChoice(2)
    assert drive(choice, slight, 30)[2:].count(2) >= 25  # docs: the faster count
    queries = drive(choice, slight, 30, tokens=10)
    assert queries[:2] == [2, 1] and queries[2:].count(1) >= 25
    plenty = ThreadChoice(8)
    assert drive(plenty, {8: 1.0, 1: 4.0}, 30, tokens=10)[2:].count(8) >= 25  # many cores: the pool
