"""pollen's engine in this process: texts in, the vectors `pollen serve` answers out, no server hop.

The same parts as the server, in one process:
- tokenization by server/pipeline/tokenizer.py's TextTokenizer (the model's tokenizer.json, its special
  tokens, truncation, the checkpoint's default prompt), checked as admission checks a request;
- token-budget batches packed without padding (worker/packed.py), consecutive texts in each;
- the engine the workers run (on the CPU ONNX Runtime's or torch's, chosen as `pollen serve
  --cpu-engine` chooses: server/process/cpu_engines.py; on CUDA the CUDA engine, eagerly: bulk batches are
  large enough that the device, not kernel launches, sets the pace);
- L2 normalization on the device, or, with a Matryoshka cut, worker/postprocess.py's finish.

On CUDA, batch N+1 is tokenized, packed and submitted before batch N's rows are read back, so
the CPU's work hides under the device's.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from pollen.common import defaults, onnx_cache
from pollen.common.engine_options import EngineOptions
from pollen.common.errors import RequestError
from pollen.common.model_spec import ModelSpec, default_model_path, read_model_spec
from pollen.common.request import TRUNCATE_BY_NAME
from pollen.server.config import CPU_ENGINES, usable_cores
from pollen.server.pipeline.admission import ModelChecks
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.server.process.cpu_engines import onnx_refusal
from pollen.v1 import embedder_pb2 as pb
from pollen.worker.engine import make_engine
from pollen.worker.models.loader import load_model
from pollen.worker.onnx_engine import OnnxEngine
from pollen.worker.packed import pack
from pollen.worker.postprocess import finish

# Texts tokenized at a time: small enough that tokenizing overlaps the device's work on a batch.
TOKENIZE_GROUP = 64


def onnx_engine(spec: ModelSpec, cpu_engine: str, dtype: str, threads: int, cache: str | None) -> OnnxEngine | None:
    """The ONNX Runtime engine of the model where `cpu_engine` and the model allow it, its export
    made where the cache lacks it; None for torch. ValueError where "onnx" cannot be had."""
    if cpu_engine not in CPU_ENGINES:
        raise ValueError(f"cpu_engine must be one of {', '.join(CPU_ENGINES)}, got {cpu_engine!r}")
    if cpu_engine == "torch":
        return None
    refusal = onnx_refusal(spec, dtype)
    if refusal is None:
        export = onnx_cache.pollen_exports([spec], cache or onnx_cache.default_folder())[0]
        refusal = export.error and f"its ONNX export failed: {export.error}"
    if refusal is None:
        return OnnxEngine(spec, export.path, threads or usable_cores())
    if cpu_engine == "onnx":
        raise ValueError(f"{spec.path}: cpu_engine onnx is refused: {refusal}")
    return None


class BulkEmbedder:
    """`BulkEmbedder(model_dir, device="cuda").embed(texts)`: float32 [len(texts), dims] rows.

    truncate: "end" (keep the start; the default here, as a corpus has long texts), "start" or
    "none" (a text over the model's limit is an error). prompt_name / prompt: as EmbedRequest's (the
    checkpoint's default prompt applies without either). dimensions: a Matryoshka prefix (0: full).
    max_batch_tokens: tokens per engine batch (0: what `pollen serve` takes for the device, the
    threads and the model: common/defaults.py). threads: the CPU engine's threads (0: torch's as
    they are, ONNX Runtime's the usable cores; a Ray actor's are its num_cpus). cpu_engine:
    "auto", "onnx" or "torch", as `pollen serve --cpu-engine` (an export is made once into
    onnx_cache, default pollen's cache).
    """

    def __init__(self, model: str | None = None, *, device: str = "cpu", dtype: str = "auto",
                 truncate: str = "end", prompt_name: str = "", prompt: str = "", dimensions: int = 0,
                 normalize: bool = True, max_batch_tokens: int = 0, threads: int = 0,
                 pooling: str | None = None, attention: str | None = None, cpu_engine: str = "auto",
                 onnx_cache: str | None = None):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        if truncate not in TRUNCATE_BY_NAME:
            raise ValueError(f"truncate must be one of {', '.join(TRUNCATE_BY_NAME)}, got {truncate!r}")
        self.spec = read_model_spec(model or default_model_path(), pooling=pooling, attention=attention)
        if self.spec.task != "embed":  # its rows would be scores, one or one per label, not vectors
            raise ValueError(f"{self.spec.path}: pollen bulk embeds, and this model serves {self.spec.task} "
                             f"({self.spec.task_reason})")
        self.tokenizer = TextTokenizer(self.spec.path, self.spec.max_tokens)
        checks = ModelChecks(self.spec, self.tokenizer)  # the server's checks of the options
        try:
            checks.check_dimensions(dimensions)
            self.prompt = checks.prompt(prompt_name, prompt, self.spec.max_tokens)
        except RequestError as exc:
            raise ValueError(exc.message) from None
        self.truncate, self.dimensions, self.normalize = TRUNCATE_BY_NAME[truncate], dimensions, normalize
        self.max_batch_tokens = max_batch_tokens or defaults.batch_tokens(device, threads or usable_cores(),
                                                                          self.spec.max_tokens)
        if self.max_batch_tokens < self.spec.max_tokens:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} is below the model's limit of "
                             f"{self.spec.max_tokens} tokens: one long text could never be batched")
        if dtype == "auto":
            dtype = defaults.dtype(device)
        self.engine = onnx_engine(self.spec, cpu_engine, dtype, threads, onnx_cache) if device == "cpu" else None
        if self.engine is None:
            if threads:
                torch.set_num_threads(threads)
            weights = load_model(self.spec.path, device=device, dtype=getattr(torch, dtype), pooling=pooling,
                                 attention=attention, options=EngineOptions())
            self.engine = make_engine(weights, device, max_batch_tokens=self.max_batch_tokens, cuda_graphs=False)

    @property
    def dims(self) -> int:
        return self.dimensions or self.spec.hidden_size

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One float32 row per text, in order; ValueError naming the text for an empty or
        non-string one (or, with truncate "none", one over the model's limit)."""
        out = np.empty((len(texts), self.dims), dtype=np.float32)
        in_flight = None  # (first row, rows, pending) of the batch on the device
        for start, seqs in self.batches(texts):
            flags = np.ones(len(seqs), np.int32) if self.normalize and not self.dimensions else None
            submitted = (start, len(seqs), self.engine.submit(pack(seqs), normalize=flags))
            if in_flight is not None:
                self.collect(*in_flight, out)
            in_flight = submitted
        if in_flight is not None:
            self.collect(*in_flight, out)
        return out

    def collect(self, start: int, rows: int, pending, out: np.ndarray) -> None:
        """A batch's rows into out[start:start + rows], cut and normalized when a cut was asked (or
        the rows are wider than the vectors: BGE-M3's carry its heads' outputs after them)."""
        pooled = pending.result()
        if self.dimensions or pooled.shape[1] != self.dims:
            finish(pooled, self.dims, self.normalize, pb.ENCODING_FLOAT32,
                   memoryview(out[start:start + rows]).cast("B"))
        else:
            out[start:start + rows] = pooled

    def batches(self, texts: Sequence[str]) -> Iterator[tuple[int, list[np.ndarray]]]:
        """(index of the first text, token ids of consecutive texts) of at most max_batch_tokens."""
        start, seqs, tokens = 0, [], 0
        for at in range(0, len(texts), TOKENIZE_GROUP):
            for ids in self.encode(texts, at):
                if seqs and tokens + len(ids) > self.max_batch_tokens:
                    yield start, seqs
                    start, seqs, tokens = start + len(seqs), [], 0
                seqs.append(ids)
                tokens += len(ids)
        if seqs:
            yield start, seqs

    def encode(self, texts: Sequence[str], at: int) -> list[np.ndarray]:
        """Token ids of texts[at:at + TOKENIZE_GROUP], as the server's admission makes them."""
        group = texts[at:at + TOKENIZE_GROUP]
        for i, text in enumerate(group):
            if not isinstance(text, str) or not text:
                kind = "empty" if isinstance(text, str) else f"not a string but {type(text).__name__}"
                raise ValueError(f"text {at + i} (of {len(texts)}) is {kind}: every text needs at least one character")
        try:
            return self.tokenizer.encode(list(group), self.truncate, self.spec.max_tokens, self.prompt)
        except RequestError as exc:
            raise ValueError(f"texts {at}..{at + len(group) - 1}: {exc.message}") from None
