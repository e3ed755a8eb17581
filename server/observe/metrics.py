"""Prometheus metrics for both doors (gRPC and HTTP), served at the HTTP door's GET /metrics.

Defined here, in one place, and incremented where the event happens:
- the doors count requests, texts, tokens and errors (label `door`: "grpc" or "http");
- each frontend's channels observe queue and inference times from each answer, and batch sizes
  and sequences from the workers' batch records;
- drops (deadline passed, client gone) are counted once, where the request is dropped or where the
  worker reports that it dropped it;
- the supervisor counts worker restarts.

The figures are whole-server figures although several processes count them: `pollen serve` sets
PROMETHEUS_MULTIPROC_DIR for itself and its frontends (before prometheus_client is imported), each
process writes its counts there, and /metrics sums them (prometheus_client's multiprocess mode).
`pollen_queued_tokens` is read from the server state at each scrape (shared_mem/server_state.py).

The per-request counts (requests, texts, tokens, queue and inference times, batches) are added
up in this process's memory and written to prometheus_client at most FLUSH_S later (`DEFERRED`):
in multiprocess mode every increment takes a lock, checks the pid and writes the mmap file, and a
query made seven of them. A scrape writes out its
own process's counts first; another frontend's are at most FLUSH_S old.
"""
from __future__ import annotations

import asyncio
import bisect
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pollen.shared_mem.server_state import PHASES

REGISTRY = CollectorRegistry(auto_describe=True)
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

# Latency buckets from a tenth of a millisecond (a graphed query on a GPU) to 30 s (a full queue).
_SECONDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TOKENS = tuple(2 ** i for i in range(4, 18))  # 16 .. 131072

REQUESTS = Counter("pollen_requests", "Requests answered, by door, outcome (ok or a status name) and task "
                   "(embed, rerank, classify).", ["door", "outcome", "task"], registry=REGISTRY)
TEXTS = Counter("pollen_texts", "Texts (or chunks, or rerank documents) answered, by door and task.",
                ["door", "task"], registry=REGISTRY)
TOKENS = Counter("pollen_tokens", "Tokens sent to the model, by door and task.", ["door", "task"], registry=REGISTRY)
# The task each counted gRPC method and HTTP route serves: the `task` label.
TASK_OF = {"Embed": "embed", "EmbedStream": "embed", "Rerank": "rerank", "RerankStream": "rerank",
           "Classify": "classify", "/v1/embeddings": "embed", "/v1/rerank": "rerank", "/v2/rerank": "rerank",
           "/v1/classify": "classify"}
DROPPED = Counter("pollen_dropped", "Requests dropped before reaching the model, by reason "
                  "(deadline, cancelled).", ["reason"], registry=REGISTRY)
QUEUE_SECONDS = Histogram("pollen_queue_seconds", "Admission to the start of the batch holding a "
                          "request's last text.", buckets=_SECONDS, registry=REGISTRY)
INFERENCE_SECONDS = Histogram("pollen_inference_seconds", "First batch start to last batch end of a request.",
                              buckets=_SECONDS, registry=REGISTRY)
BATCH_TOKENS = Histogram("pollen_batch_tokens", "Tokens in each batch a worker ran.", buckets=_TOKENS,
                         registry=REGISTRY)
SEQUENCES = Counter("pollen_sequences", "Sequences (texts, windows, chunk documents) the workers ran.",
                    registry=REGISTRY)
# Set by each frontend from a worker's READY record (worker/main.py measures it); the same figure
# from every frontend, so the multiprocess value is their max.
MODEL_MEMORY = Gauge("pollen_model_memory_bytes", "Device memory each model holds in each worker once warm (on CUDA "
                     "what the allocator holds for it: weights, buffers, graphs; on the CPU its weights).",
                     ["model", "worker"], multiprocess_mode="max", registry=REGISTRY)
WORKER_RESTARTS = Counter("pollen_worker_restarts", "Worker processes restarted after dying (or hanging).",
                          registry=REGISTRY)


# How long a count may wait in a process's memory before prometheus_client has it.
FLUSH_S = 0.5


class Deferred:
    """Counter increments and histogram observations kept here until `flush`, which writes each
    counter once and each histogram bucket once. A flush is scheduled on the running event loop
    FLUSH_S after the first count since the last one; without a running loop (tests, tools), a
    count is written at once. A frontend has one loop for its life; the flush is scheduled again
    when counts come from another loop (a loop that closed with its flush pending never runs it)."""

    def __init__(self):
        self.counts: dict = {}       # counter (or labelled child) -> amount
        self.observed: dict = {}     # histogram -> [per-bucket counts (the last is +Inf), sum]
        self.scheduled_on = None     # the loop whose timer will flush, if any

    def inc(self, counter, amount: float = 1) -> None:
        self.counts[counter] = self.counts.get(counter, 0) + amount
        self._schedule()

    def observe(self, histogram: Histogram, value: float) -> None:
        entry = self.observed.get(histogram)
        if entry is None:
            entry = self.observed[histogram] = [[0] * len(histogram._upper_bounds), 0.0]
        # The first bound >= value, as observe() picks it (the bounds end with +Inf).
        entry[0][bisect.bisect_left(histogram._upper_bounds, value)] += 1
        entry[1] += value
        self._schedule()

    def _schedule(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop here: write now
            self.flush()
            return
        if self.scheduled_on is not loop:
            loop.call_later(FLUSH_S, self.flush)
            self.scheduled_on = loop

    def flush(self) -> None:
        self.scheduled_on = None
        counts, self.counts = self.counts, {}
        observed, self.observed = self.observed, {}
        for counter, amount in counts.items():
            counter.inc(amount)
        for histogram, (buckets, total) in observed.items():
            # prometheus_client has no public call that adds n observations at once; its
            # Histogram keeps its bounds, one value per bucket and one for the sum
            # (tests/test_metrics_deferred.py checks the exposition against plain observe()).
            for value, n in zip(histogram._buckets, buckets):
                if n:
                    value.inc(n)
            histogram._sum.inc(total)


DEFERRED = Deferred()


class _FlushFirst:
    """Collected first at a scrape: writes this process's deferred counts out, yields nothing."""

    def collect(self):
        DEFERRED.flush()
        return iter(())


class StateCollector:
    """Figures read from the server state at each scrape: queued tokens and ready workers."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        yield GaugeMetricFamily("pollen_queued_tokens", "Tokens admitted and not yet answered, over all workers.",
                                value=self.state.queued_total())
        yield GaugeMetricFamily("pollen_backlog_requests", "Requests waiting in the frontends for room in a "
                                "request ring.", value=self.state.backlog_total())
        yield GaugeMetricFamily("pollen_ready_workers", "Workers loaded and serving.",
                                value=sum(self.state.ready(w) for w in range(self.state.workers)))
        phases = CounterMetricFamily("pollen_worker_seconds", "Time each worker's loop has spent in each phase "
                                     "(requests, launch, answer, wait): a worker busy all the time is the "
                                     "bottleneck.", labels=["worker", "phase"])
        batches = CounterMetricFamily("pollen_worker_batches", "Batches each worker has run.", labels=["worker"])
        eager = CounterMetricFamily("pollen_worker_eager_batches", "cuda: batches of a graph-sized bucket that ran "
                                    "eagerly (no captured graph held them): milliseconds of the worker's CPU each.",
                                    labels=["worker"])
        padded = CounterMetricFamily("pollen_worker_padded_batches", "cuda: batches run padded in a larger captured "
                                     "graph than their own bucket's (not captured yet).", labels=["worker"])
        graphs = GaugeMetricFamily("pollen_worker_graphs", "cuda: CUDA graphs each worker holds (both lanes).",
                                   labels=["worker"])
        for w in range(self.state.workers):
            for phase, ns in zip(PHASES, self.state.phase_view(w).tolist()):
                phases.add_metric([str(w), phase], ns / 1e9)
            batches.add_metric([str(w)], self.state.batches(w))
            for family, value in zip((eager, padded, graphs), self.state.counts_view(w).tolist()):
                family.add_metric([str(w)], value)
        yield from (phases, batches, eager, padded, graphs)


def exposition(state=None) -> CollectorRegistry:
    """The registry /metrics serializes: every process's counts summed (multiprocess mode), or
    this process's own; plus the server state's figures."""
    registry = CollectorRegistry()
    registry.register(_FlushFirst())  # collectors are collected in the order they were registered
    if MULTIPROCESS:
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_Forward(REGISTRY))
    if state is not None:
        registry.register(StateCollector(state))
    return registry


class _Forward:
    """Another registry's metrics, collected into this one."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        return self.registry.collect()


# The labelled children count_request increments, resolved once per label set: `labels()` costs
# more than the increment itself (it checks and joins the values and takes the metric's lock), and
# it ran three times per request. The doors, outcomes and tasks are few (2 x the status codes x 3).
_REQUEST_COUNTERS: dict[tuple[str, str, str], tuple] = {}


def count_request(door: str, outcome: str, texts: int = 0, tokens: int = 0, task: str = "embed") -> None:
    """One request of `task` answered by a door: outcome "ok" or the gRPC status name."""
    counters = _REQUEST_COUNTERS.get((door, outcome, task))
    if counters is None:
        counters = _REQUEST_COUNTERS[door, outcome, task] = (REQUESTS.labels(door, outcome, task),
                                                             TEXTS.labels(door, task), TOKENS.labels(door, task))
    requests, text_count, token_count = counters
    DEFERRED.inc(requests)
    if texts:
        DEFERRED.inc(text_count, texts)
    if tokens:
        DEFERRED.inc(token_count, tokens)
