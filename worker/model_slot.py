"""One of a worker's models: its spec, the engine that runs it (its own weights, buffers, streams
and CUDA graphs), its batcher and its batches in flight.

A worker holds every model the server serves (`pollen serve --model E --model R`), one slot each,
in --model's order: a request record names its slot by index (common/request.py,
RequestOptions.model). The loop (worker/loop.py) launches each slot's batches on the slot's own
engine, so models never share a batch, a graph or a token budget.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pollen.common.model_spec import ModelSpec
from pollen.worker.batcher import Batcher
from pollen.worker.engine import Engine


@dataclass(slots=True, eq=False)
class ModelSlot:
    index: int           # its place in --model's list
    spec: ModelSpec
    engine: Engine
    memory: int          # bytes it holds on its device once warm (worker/main.py, load_one)
    batcher: Batcher | None = None  # the worker sets it (the row cap follows from the response ring)
    # Submitted batches whose records are not committed yet, per lane, oldest first (worker/loop.py InFlight).
    open: tuple[deque, deque] = field(default_factory=lambda: (deque(), deque()))

    @property
    def hidden(self) -> int:
        """The width of every row it writes: pooled, or a head's outputs."""
        return self.spec.output_dims

    def busy(self) -> bool:
        """A batch of it is in flight."""
        return bool(self.open[0] or self.open[1])
