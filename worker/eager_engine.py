"""The torch CPU engine: a model's packed forward op by op, the reference for the CUDA engine.

How a batch is spread over the threads (pieces, the thread choice) is worker/cpu_engine.py's CpuEngine;
this engine sets torch's pool of the calling thread to the count it is given, runs the model and
pools its hidden states (worker/models/pooling.py), then the model's head or normalization
(EmbeddingModel.output_rows).
"""
from __future__ import annotations

import numpy as np
import torch

from pollen.worker.cpu_engine import CpuEngine
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.pooling import pool_rows
from pollen.worker.packed import PackedBatch, padded

# oneDNN makes (JIT code, buffers) and keeps a primitive for every row count a product sees. Batches
# of texts come in every size, so without a bound on the sizes its cache fills with hundreds of
# them per weight, each one's making paid on the batch that first has that size, and the worker's
# memory grows with them. A batch of ROUND_FROM tokens or more is therefore padded (a padding
# sequence pooled into no row, packed.padded) to a multiple of ROUND_TOKENS: at most a few dozen
# sizes per weight under the CPU's batch budget, for at most ROUND_TOKENS - 1 tokens of work more.
# Queries (fewer tokens) keep their exact size: their latency is the point, and their sizes are few.
ROUND_FROM, ROUND_TOKENS = 64, 32


class EagerEngine(CpuEngine):
    """Op-by-op execution on the CPU: simple, exact, and the reference for the CUDA engine."""

    def __init__(self, model: EmbeddingModel, threads: int | None = None, adapt_threads: bool = True,
                 pieces: bool = True):
        super().__init__(threads or torch.get_num_threads(), adapt_threads, pieces)
        self.model = model
        self.pooling = model.spec.pooling

    def _rows(self, batch: PackedBatch, threads: int) -> torch.Tensor:
        """The batch's pooled rows, float32 [rows, hidden] (before the head), on `threads` of
        torch's threads (its pool is the calling thread's)."""
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        t = torch.from_numpy
        if batch.tokens >= ROUND_FROM:
            batch = padded(batch, ROUND_TOKENS)
        with torch.inference_mode():  # per thread: the helpers need their own
            hidden = self.model.hidden_states(t(batch.ids), t(batch.positions), t(batch.cu_seqlens),
                                              batch.max_seqlen)
            return pool_rows(hidden, t(batch.pool_index), t(batch.pool_first), t(batch.pool_last),
                             t(batch.pool_count), self.pooling)

    def _join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)

    def _output(self, rows: torch.Tensor, normalize: np.ndarray | None) -> np.ndarray:
        with torch.inference_mode():
            flags = None if normalize is None else torch.from_numpy(np.asarray(normalize, dtype=np.int32))
            return self.model.output_rows(rows, flags).numpy()
