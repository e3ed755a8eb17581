"""server/observe/metrics.py's Deferred: counts kept in memory and written out at once give the very
exposition that prometheus_client's own inc() and observe() give, and are written FLUSH_S later."""
from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pollen.server.observe import metrics
from pollen.server.observe.metrics import Deferred

BOUNDS = (0.001, 0.01, 0.1, 1.0)


def pair(name: str):
    """Two identical registries, each with one counter and one histogram."""
    out = []
    for _ in range(2):
        registry = CollectorRegistry()
        out.append((registry, Counter(f"{name}_things", "Things.", ["kind"], registry=registry),
                    Histogram(f"{name}_seconds", "Seconds.", buckets=BOUNDS, registry=registry)))
    return out


def samples(registry) -> dict:
    """Every sample of the exposition but the creation times (which differ by when each was made)."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if not s.name.endswith("_created")}


def test_a_flush_gives_what_plain_increments_give():
    (plain, plain_counter, plain_hist), (kept, kept_counter, kept_hist) = pair("t")
    deferred = Deferred()
    rng = random.Random(0)
    values = [rng.choice(BOUNDS) for _ in range(50)] + [rng.uniform(0, 2) for _ in range(500)] + [5.0, 0.0]

    async def count():  # on a loop, so nothing is written before the flush
        for i, v in enumerate(values):
            plain_hist.observe(v)
            deferred.observe(kept_hist, v)
            kind = ("a", "b")[i % 2]
            plain_counter.labels(kind).inc(i)
            deferred.inc(kept_counter.labels(kind), i)
        assert samples(kept) != samples(plain)  # kept back until the flush
        deferred.flush()

    asyncio.run(count())
    assert samples(kept) == samples(plain)
    assert samples(kept)[("t_seconds_bucket", (("le", "+Inf"),))] == len(values)


def test_counts_are_written_flush_s_later_on_a_loop_and_at_once_without_one(monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 0.05)
    (_, counter, _), _ = pair("u")
    deferred = Deferred()
    deferred.inc(counter.labels("x"), 2)  # no running loop: written now
    assert counter.labels("x")._value.get() == 2

    async def later():
        deferred.inc(counter.labels("x"), 3)
        assert counter.labels("x")._value.get() == 2
        await asyncio.sleep(0.2)
        return counter.labels("x")._value.get()

    assert asyncio.run(later()) == 5


def test_a_loop_that_closed_with_its_flush_pending_does_not_stop_later_flushes(monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 0.05)
    (_, counter, _), _ = pair("v")
    deferred = Deferred()

    async def count(n: int, wait: float) -> None:
        deferred.inc(counter.labels("x"), n)
        await asyncio.sleep(wait)

    asyncio.run(count(1, 0.0))  # this loop ends before its flush is due
    assert counter.labels("x")._value.get() == 0
    asyncio.run(count(2, 0.2))  # the next loop schedules its own
    assert counter.labels("x")._value.get() == 3


def test_a_scrape_writes_the_scraped_process_s_counts_first():
    before = metrics.REQUESTS.labels("grpc", "ok", "embed")._value.get()

    async def count_then_scrape():
        metrics.count_request("grpc", "ok", 1, 7)
        return generate_latest(metrics.exposition())

    text = asyncio.run(count_then_scrape()).decode()
    assert f'pollen_requests_total{{door="grpc",outcome="ok",task="embed"}} {before + 1:.1f}' in text
