"""The worker's configuration: built by the frontend, sent as JSON on the worker's command line."""
from __future__ import annotations

import dataclasses
import json

from pollen.common.engine_options import EngineOptions


@dataclasses.dataclass(slots=True)
class WorkerConfig:
    index: int
    model: str
    device: str
    threads: int
    max_batch_tokens: int
    parent_pid: int
    control_fd: int               # the worker's end of its control link (common/control.py), inherited
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
    bulk_batch_tokens: int = 0  # cap on bulk tokens per batch; 0: max_batch_tokens
    bulk_sms: int = 0  # cuda: SMs of the bulk lane (ServeConfig.bulk_sms; -1 default, 0 all)
    spin_us: int = 0  # poll the request rings this long before sleeping (ServeConfig.worker_spin_us)
    warmup_s: float = 0.0  # seconds of graph captures before READY (ServeConfig.warmup_seconds)
    engine_options: EngineOptions = dataclasses.field(default_factory=EngineOptions)  # the kernels' switches

    def __post_init__(self) -> None:
        if isinstance(self.engine_options, dict):  # as to_json wrote it
            self.engine_options = EngineOptions(**self.engine_options)
        if self.threads < 1 or self.max_batch_tokens < 1:
            raise ValueError(f"threads and max_batch_tokens must be positive: {self}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))
