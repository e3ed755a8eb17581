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
"""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pollen.shared_mem.server_state import PHASES

REGISTRY = CollectorRegistry(auto_describe=True)
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

# Latency buckets from 100 µs (one graphed query on a GPU) to 30 s (a full queue).
_SECONDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TOKENS = tuple(2 ** i for i in range(4, 18))  # 16 .. 131072

REQUESTS = Counter("pollen_requests", "Embedding requests answered, by door and outcome (ok or a status name).",
                   ["door", "outcome"], registry=REGISTRY)
TEXTS = Counter("pollen_texts", "Texts (or chunks) embedded, by door.", ["door"], registry=REGISTRY)
TOKENS = Counter("pollen_tokens", "Tokens sent to the model, by door.", ["door"], registry=REGISTRY)
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
WORKER_RESTARTS = Counter("pollen_worker_restarts", "Worker processes restarted after dying (or hanging).",
                          registry=REGISTRY)


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
        for w in range(self.state.workers):
            for phase, ns in zip(PHASES, self.state.phase_view(w).tolist()):
                phases.add_metric([str(w), phase], ns / 1e9)
        yield phases


def exposition(state=None) -> CollectorRegistry:
    """The registry /metrics serializes: every process's counts summed (multiprocess mode), or
    this process's own; plus the server state's figures."""
    if MULTIPROCESS:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = CollectorRegistry()
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
# it ran three times per request. Both the doors and the outcomes are few (2 x the status codes).
_REQUEST_COUNTERS: dict[tuple[str, str], tuple] = {}


def count_request(door: str, outcome: str, texts: int = 0, tokens: int = 0) -> None:
    """One embedding request answered by a door: outcome "ok" or the gRPC status name."""
    counters = _REQUEST_COUNTERS.get((door, outcome))
    if counters is None:
        counters = _REQUEST_COUNTERS[door, outcome] = (REQUESTS.labels(door, outcome), TEXTS.labels(door),
                                                       TOKENS.labels(door))
    requests, text_count, token_count = counters
    requests.inc()
    if texts:
        text_count.inc(texts)
    if tokens:
        token_count.inc(tokens)
