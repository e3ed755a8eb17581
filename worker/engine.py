"""Engines run packed batches through a model and write pooled rows where the caller says.

The worker loop only knows this interface:

    engine.register_host_memory(address, nbytes)   # each response ring's segment, once
    pending = engine.submit(batch, out=[rows_view, ...], normalize=flags, lane=Lane.INTERACTIVE)
                                     # starts the work; may return before it is done
    pending.done()                   # True once out holds the rows (never blocks)
    pending.result()                 # waits until out holds the rows; returns out
    engine.capture_one()             # no interactive work: capture a graph a batch missed (CUDA)
    engine.wants_capture(n)          # under load: a bucket n batches ran eagerly in waits (CUDA)
    engine.capture_one(n)            # ... capture it (no interactive batch in flight)
    engine.graph_counts()            # (eager batches, padded batches, graphs held): /metrics (CUDA)
    engine.unregister_host_memory(address)         # before a response ring goes
    engine.close()

`pending` is a `PendingRows`: the CPU engine's is done when submit returns; the CUDA engine's is
a LazyTensor (worker/lazy.py), done once the device's copies have landed. `engine.side_by_side`
says whether the engine runs its two lanes (INTERACTIVE, BULK) at once: the CUDA engine does, on
streams of two priorities; the CPU engine runs one batch at a time and ignores `lane`.

`out` is a float32 [batch.rows, hidden] numpy array, or a list of them whose rows add up to the
batch's, filled in order: for the worker, views of the batch's records in the response rings of
the frontends it holds requests of (shared_mem/records.py, BATCH_RESULT), so the rows never pass
through another buffer. `normalize` holds one int per row: non-zero rows are L2-normalized on the
engine's device right after pooling. Without `out` the engine returns rows of its own (tests,
benchmarks). The loop can submit batch N+1 before it waits on batch N (on CUDA that hides the
CPU's preparation under the GPU's work; on the CPU, submit simply computes). `make_engine` picks
the engine for the worker's device.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from pollen.common.request import Lane
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.pooling import normalize_rows, pool_rows
from pollen.worker.packed import PackedBatch, warm_up_batch


class PendingRows(Protocol):
    """A submitted batch's rows: `done()` never blocks; `result()` waits and returns them (the
    caller's `out`, or the engine's own array)."""

    def done(self) -> bool: ...

    def result(self): ...


class ReadyRows:
    """Rows computed already: the CPU engine's PendingRows."""

    __slots__ = ("rows",)

    def __init__(self, rows):
        self.rows = rows

    def done(self) -> bool:
        return True  # the worker answers it at once instead of after the next batch

    def result(self):
        return self.rows


class EagerEngine:
    """Op-by-op execution on the CPU: simple, exact, and the reference for the CUDA engine."""

    side_by_side = False  # one batch at a time: the lanes mix in the batcher instead

    def __init__(self, model: EmbeddingModel):
        self.model = model
        self.pooling = model.spec.pooling

    def submit(self, batch: PackedBatch, out=None, normalize: np.ndarray | None = None,
               lane: Lane = Lane.INTERACTIVE) -> ReadyRows:
        t = torch.from_numpy
        with torch.inference_mode():
            hidden = self.model.hidden_states(t(batch.ids), t(batch.positions), t(batch.cu_seqlens),
                                              batch.max_seqlen)
            rows = pool_rows(hidden, t(batch.pool_index), t(batch.pool_first), t(batch.pool_last),
                             t(batch.pool_count), self.pooling)
            if normalize is not None:
                rows = normalize_rows(rows, t(np.asarray(normalize, dtype=np.int32)))
            if out is None:
                return ReadyRows(rows.numpy())
            at = 0
            for part in out if isinstance(out, list) else [out]:
                t(part).copy_(rows[at:at + len(part)])
                at += len(part)
        return ReadyRows(out)

    def wants_capture(self, min_hits: int) -> bool:
        return False  # nothing to capture on the CPU

    def capture_one(self, min_hits: int = 0) -> bool:
        return False

    def graph_counts(self) -> tuple[int, int, int]:
        return 0, 0, 0  # no graphs on the CPU

    def register_host_memory(self, address: int, nbytes: int) -> None:
        """Nothing to do: the CPU writes any memory directly."""

    def unregister_host_memory(self, address: int) -> None:
        """Nothing to do (see register_host_memory)."""

    def close(self) -> None:
        pass

    def warm_up(self, budget_s: float = 0.0) -> None:
        """Pay first-call costs (allocator, kernels) before the worker says READY."""
        self.submit(warm_up_batch()).result()


def make_engine(model: EmbeddingModel, device: str, **options) -> EagerEngine:
    """options (max_batch_tokens, cuda_graphs, graph_max_tokens, defer_capture, bulk_sms) matter
    to the CUDA engine only."""
    if device.startswith("cuda"):
        from pollen.worker.cuda_engine import CudaEngine

        return CudaEngine(model, device, **options)
    return EagerEngine(model)
