"""Engines run packed batches through a model and write pooled rows where the caller says.

`Engine` is all the worker loop knows of one; `make_engine` picks the engine for the worker's
device: the CUDA engine (worker/cuda_engine.py) or the CPU engine here, the reference for it.
The loop can submit batch N+1 before it waits on batch N: on CUDA that hides the CPU's
preparation under the GPU's work; on the CPU, submit simply computes.
"""
from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from pollen.common.request import Lane
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.pooling import pool_rows
from pollen.worker.packed import PackedBatch, warm_up_batch
from pollen.worker.thread_choice import ThreadChoice


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
    bulk_sms = 0

    def __init__(self, model: EmbeddingModel, threads: int | None = None, adapt_threads: bool = True):
        self.model = model
        self.pooling = model.spec.pooling
        self.threads = ThreadChoice(threads or torch.get_num_threads(), adapt_threads)

    def submit(self, batch: PackedBatch, out=None, normalize: np.ndarray | None = None,
               lane: Lane = Lane.INTERACTIVE) -> ReadyRows:
        tokens = len(batch.ids)
        threads = self.threads.threads_for(tokens)
        started = time.perf_counter()
        rows = self._run(batch, out, normalize)
        self.threads.ran(threads, tokens, time.perf_counter() - started)
        return rows

    def _run(self, batch: PackedBatch, out, normalize: np.ndarray | None) -> ReadyRows:
        t = torch.from_numpy
        with torch.inference_mode():
            hidden = self.model.hidden_states(t(batch.ids), t(batch.positions), t(batch.cu_seqlens),
                                              batch.max_seqlen)
            rows = pool_rows(hidden, t(batch.pool_index), t(batch.pool_first), t(batch.pool_last),
                             t(batch.pool_count), self.pooling)
            flags = None if normalize is None else t(np.asarray(normalize, dtype=np.int32))
            rows = self.model.output_rows(rows, flags)
            if out is None:
                return ReadyRows(rows.numpy())
            at = 0
            for part in out if isinstance(out, list) else [out]:
                t(part).copy_(rows[at:at + len(part)])
                at += len(part)
        return ReadyRows(out)

    def between_batches(self, interactive_waiting: bool, interactive_in_flight: bool, now_ns: int) -> bool:
        return False  # nothing runs beside the batches on the CPU

    def keep_counts_in(self, counts: np.ndarray) -> None:
        """Nothing to count: no graphs on the CPU."""

    def register_host_memory(self, address: int, nbytes: int) -> None:
        """Nothing to do: the CPU writes any memory directly."""

    def unregister_host_memory(self, address: int) -> None:
        """Nothing to do (see register_host_memory)."""

    def close(self) -> None:
        pass

    def warm_up(self, budget_s: float = 0.0) -> None:
        self.submit(warm_up_batch()).result()


def make_engine(model: EmbeddingModel, device: str, threads: int | None = None, adapt_threads: bool = True,
                **options) -> Engine:
    """threads and adapt_threads matter to the CPU engine only (worker/thread_choice.py); options
    (max_batch_tokens, cuda_graphs, graph_max_tokens, defer_capture, bulk_sms, interactive_step)
    to the CUDA engine only."""
    if device.startswith("cuda"):
        from pollen.worker.cuda_engine import CudaEngine

        return CudaEngine(model, device, **options)
    return EagerEngine(model, threads, adapt_threads)
