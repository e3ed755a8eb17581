"""A worker's configuration: derived from the server's (WorkerConfig.of) by the supervisor, sent as
JSON on the worker's command line."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING

from pollen.common.engine_options import EngineOptions

if TYPE_CHECKING:
    from pollen.server.config import ServeConfig


@dataclasses.dataclass(slots=True)
class WorkerConfig:
    index: int
    model: str
    device: str
    threads: int
    max_batch_tokens: int
    parent_pid: int
    control_fd: int               # the worker's end of its control socket (common/control.py), inherited
    state: str                    # the server state segment (shared_mem/server_state.py)
    response_ring_bytes: int      # every response ring's size (the batcher's row cap follows from it)
    gpu: int = -1                 # cuda: the GPU index this worker owns, as the server numbers them; -1 on the cpu
    cuda_device: str = ""         # cuda: CUDA_VISIBLE_DEVICES for the worker (the physical GPU)
    cpu_cores: list = dataclasses.field(default_factory=list)  # affinity; empty: leave as is
    dtype: str = "float32"
    cuda_graphs: bool = True
    graph_max_tokens: int = 8192
    pooling: str | None = None
    attention: str | None = None
    quantization: str = "none"  # per model, comma-separated in --model's order (ServeConfig.quantizations)
    sparse_max_terms: int = 1024  # the width of a SPLADE model's answer rows (--sparse-max-terms)
    task: str = "auto"  # per model, comma-separated in --model's order (ServeConfig.tasks): its head follows
    bulk_batch_tokens: int = 0  # cap on bulk tokens per batch; 0: max_batch_tokens
    bulk_sms: int = 0  # cuda: SMs of the bulk lane (ServeConfig.bulk_sms)
    spin_us: int = 0  # microseconds the loop polls the request rings before it sleeps
    adapt_worker_threads: bool = True  # cpu: one thread or `threads` per batch, measured (worker/thread_choice.py)
    warmup_seconds: float = 0.0  # seconds of graph captures before READY
    # cpu: per model, comma-separated in --model's order, the folder of the ONNX export ONNX Runtime
    # runs it from, or "" where torch runs it (ServeConfig.onnx_exports, server/process/cpu_engines.py)
    onnx_exports: str = ""
    engine_options: EngineOptions = dataclasses.field(default_factory=EngineOptions)  # the kernels' switches

    def __post_init__(self) -> None:
        if isinstance(self.engine_options, dict):  # as to_json wrote it
            self.engine_options = EngineOptions(**self.engine_options)
        if self.threads < 1 or self.max_batch_tokens < 1:
            raise ValueError(f"threads and max_batch_tokens must be positive: {self}")

    @classmethod
    def of(cls, serve: ServeConfig, index: int, *, control_fd: int, state: str, cpu_cores: list[int]) -> WorkerConfig:
        """Worker `index`'s config: ServeConfig's fields of the same name (sized by app.check_limits),
        its worker settings, and this worker's GPU, cores, control socket and server state."""
        same = {f.name: getattr(serve, f.name) for f in dataclasses.fields(serve) if f.name in cls.__dataclass_fields__}
        cuda = serve.device == "cuda"
        return cls(**{**same, "dtype": serve.worker_dtype(), "cuda_graphs": serve.cuda_graphs == "on",
                      "quantization": ",".join(serve.quantizations()), "task": ",".join(serve.tasks())},
                   index=index, threads=serve.worker_threads, parent_pid=os.getpid(), control_fd=control_fd,
                   state=state, gpu=serve.gpu_list()[index] if cuda else -1, cpu_cores=cpu_cores,
                   cuda_device=serve.cuda_device(index) if cuda else "", spin_us=serve.worker_spin_us,
                   engine_options=serve.engine_options())

    def quantization_of(self, index: int) -> str:
        """Model `index`'s quantization."""
        return self.quantization.split(",")[index]

    def task_of(self, index: int) -> str:
        """Model `index`'s --task."""
        return self.task.split(",")[index]

    def onnx_export_of(self, index: int) -> str:
        """Model `index`'s ONNX export folder; "" where torch runs it."""
        return self.onnx_exports.split(",")[index] if self.onnx_exports else ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))
