"""Engines run packed batches through a model and write pooled rows where the caller says.

`Engine` is all the worker loop knows of one; `make_engine` picks the engine for the worker's
device: the CUDA engine (worker/cuda_engine.py) or, on the CPU, the torch engine
(worker/eager_engine.py, the reference for the CUDA one; how it spreads a batch over threads is
worker/cpu_engine.py's). The loop can submit batch N+1 before it waits on batch N: on CUDA that hides the CPU's
preparation under the GPU's work; on the CPU, submit simply computes.

This module imports no torch (make_engine imports the engine it makes).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from pollen.common.request import Lane
from pollen.worker.packed import PackedBatch


class PendingRows(Protocol):
    """A submitted batch's rows: `done()` never blocks; `result()` waits and returns them (the
    caller's `out`, or the engine's own array)."""

    def done(self) -> bool: ...

    def result(self): ...


@runtime_checkable
class Engine(Protocol):
    """What the worker loop asks of an engine."""

    side_by_side: bool  # runs the two lanes at once (one lane's batches each); else one mixed batch at a time
    bulk_sms: int       # the SMs the bulk lane is confined to; 0: all (the READY record says it)

    def submit(self, batch: PackedBatch, out=None, normalize: np.ndarray | None = None,
               lane: Lane = Lane.INTERACTIVE) -> PendingRows:
        """Start the batch. `out` is a float32 [batch.rows, spec.output_dims] array (the pooled
        width for an embedder, a head's outputs for a reranker or classifier), or a list of them
        whose rows add up to the batch's, filled in order (for the worker, views of the batch's
        records in the response rings, shared_mem/records.py); None: the engine's own rows.
        `normalize` holds one int per row: non-zero rows of an embedder are L2-normalized on the
        engine's device (a head's rows never are: EmbeddingModel.output_rows)."""

    def between_batches(self, interactive_waiting: bool, interactive_in_flight: bool, now_ns: int) -> bool:
        """The engine's own work between the loop's turns; True while interactive launches must
        wait for it."""

    def keep_counts_in(self, counts: np.ndarray) -> None:
        """Add its graph counts (shared_mem/server_state.py, GRAPH_COUNTS) to `counts` and keep
        them there from now on (several engines may share one array)."""

    def register_host_memory(self, address: int, nbytes: int) -> None:
        """A response ring's segment, once, before rows are copied into it (once per process: the
        worker asks its first engine, and every engine on the device copies into it)."""

    def unregister_host_memory(self, address: int) -> None:
        """Before that segment goes."""

    def warm_up(self, budget_s: float = 0.0) -> None:
        """Pay first-call costs (and capture likely graphs, for up to `budget_s`) before READY."""

    def close(self) -> None: ...


def make_engine(model, device: str, *, threads: int | None = None, adapt_threads: bool = True,
                pieces: bool = True, max_batch_tokens: int = 0, cuda_graphs: bool = True,
                graph_max_tokens: int | None = None, defer_capture: bool = False, bulk_sms: int = 0,
                interactive_step: int = 0) -> Engine:
    """The engine that runs a torch model (worker/models/base.py, EmbeddingModel) on `device`.
    The CPU engine takes threads, adapt_threads (worker/thread_choice.py) and pieces
    (EngineOptions.cpu_pieces); the CUDA engine the rest, as worker/cuda_engine.py's CudaEngine
    describes them (max_batch_tokens 0: common/defaults.py's)."""
    if device.startswith("cuda"):
        from pollen.worker.cuda_engine import CudaEngine

        return CudaEngine(model, device, max_batch_tokens, cuda_graphs=cuda_graphs, graph_max_tokens=graph_max_tokens,
                          defer_capture=defer_capture, bulk_sms=bulk_sms, interactive_step=interactive_step)
    from pollen.worker.eager_engine import EagerEngine

    return EagerEngine(model, threads, adapt_threads, pieces)
