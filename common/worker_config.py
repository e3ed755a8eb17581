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
    request_ring: str
    request_fds: tuple[int, int]   # (data_fd, space_fd)
    response_ring: str
    response_fds: tuple[int, int]
    gpu: int = -1                 # cuda: the physical GPU index this worker owns; -1 on the cpu
    cpu_cores: list = dataclasses.field(default_factory=list)  # affinity; empty: leave as is
    dtype: str = "float32"
    cuda_graphs: bool = True
    graph_max_tokens: int = 8192
    pooling: str | None = None
    attention: str | None = None
    bulk_batch_tokens: int = 0  # cap on bulk tokens per batch; 0: max_batch_tokens
    spin_us: int = 0  # poll the request ring this long before sleeping (ServeConfig.worker_spin_us)
    engine_options: EngineOptions = dataclasses.field(default_factory=EngineOptions)  # the kernels' switches

    def __post_init__(self) -> None:
        self.request_fds = tuple(self.request_fds)
        self.response_fds = tuple(self.response_fds)
        if isinstance(self.engine_options, dict):  # as to_json wrote it
            self.engine_options = EngineOptions(**self.engine_options)
        if self.threads < 1 or self.max_batch_tokens < 1:
            raise ValueError(f"threads and max_batch_tokens must be positive: {self}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))
