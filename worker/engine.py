"""Engines run packed batches through a model and hand back pooled rows.

The worker loop only knows this interface:

    pending = engine.submit(batch)   # starts the work; may return before it is done
    rows = pending.result()          # float32 [batch.rows, hidden], not normalized

so the loop can submit batch N+1 before it waits on batch N (on CUDA that hides the CPU's
preparation under the GPU's work; on the CPU, submit simply computes). `make_engine` picks the
engine for the worker's device.
"""
from __future__ import annotations

import numpy as np
import torch

from worker.models.base import EmbeddingModel
from worker.models.pooling import pool_rows
from worker.packed import PackedBatch, warm_up_batch


class Done:
    """A result that is already computed (the CPU engine's pending handle)."""

    __slots__ = ("rows",)
    computed = True  # the worker answers it at once instead of after the next batch

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def result(self) -> np.ndarray:
        return self.rows


class EagerEngine:
    """Op-by-op execution on the CPU: simple, exact, and the reference for the CUDA engine."""

    def __init__(self, model: EmbeddingModel):
        self.model = model
        self.pooling = model.spec.pooling

    def submit(self, batch: PackedBatch) -> Done:
        t = torch.from_numpy
        with torch.inference_mode():
            hidden = self.model.hidden_states(t(batch.ids), t(batch.positions), t(batch.cu_seqlens),
                                              batch.max_seqlen)
            rows = pool_rows(hidden, t(batch.pool_index), t(batch.pool_first), t(batch.pool_last),
                             t(batch.pool_count), self.pooling)
        return Done(rows.numpy())

    def warm_up(self) -> None:
        """Pay first-call costs (allocator, kernels) before the worker says READY."""
        self.submit(warm_up_batch()).result()


def make_engine(model: EmbeddingModel, device: str, **options) -> EagerEngine:
    """options (max_batch_tokens, cuda_graphs, graph_max_tokens) matter to the CUDA engine only."""
    if device.startswith("cuda"):
        from worker.cuda_engine import CudaEngine

        return CudaEngine(model, device, **options)
    return EagerEngine(model)
