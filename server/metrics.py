"""Prometheus metrics for both doors (gRPC and HTTP), served at the HTTP door's GET /metrics.

Defined here, in one place, and incremented where the event happens:
- the doors count requests, texts, tokens and errors (label `door`: "grpc" or "http");
- the worker pool observes queue and inference times from each answer, and batch sizes from the
  workers' batch reports;
- drops (deadline passed, client gone) are counted once, where the request is dropped or where the
  worker reports that it dropped it.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

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
QUEUED_TOKENS = Gauge("pollen_queued_tokens", "Tokens admitted and not yet answered, over all workers.",
                      registry=REGISTRY)
WORKER_RESTARTS = Counter("pollen_worker_restarts", "Worker processes restarted after dying.", registry=REGISTRY)


def count_request(door: str, outcome: str, texts: int = 0, tokens: int = 0) -> None:
    """One embedding request answered by a door: outcome "ok" or the gRPC status name."""
    REQUESTS.labels(door, outcome).inc()
    if texts:
        TEXTS.labels(door).inc(texts)
    if tokens:
        TOKENS.labels(door).inc(tokens)
