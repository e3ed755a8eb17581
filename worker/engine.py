"""Engines run packed batches through a model and write pooled rows where the caller says.

`Engine` is all the worker loop knows of one; `make_engine` picks the engine for the worker's
device: the CUDA engine (worker/cuda_engine.py) or the CPU engine here, the reference for it.
The loop can submit batch N+1 before it waits on batch N: on CUDA that hides the CPU's
preparation under the GPU's work; on the CPU, submit simply computes.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from pollen.common.request import Lane
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.pooling import pool_rows
from pollen.worker.packed import PackedBatch, pack, padded, split, warm_up_batch
from pollen.worker.thread_choice import LEARN_TOKENS, ThreadChoice


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


# oneDNN makes (JIT code, buffers) and keeps a primitive for every row count a product sees. Batches
# of texts come in every size, so without a bound on the sizes its cache fills with hundreds of
# them per weight, each one's making paid on the batch that first has that size, and the worker's
# memory grows with them. A batch of ROUND_FROM tokens or more is therefore padded (a padding
# sequence pooled into no row, packed.padded) to a multiple of ROUND_TOKENS: at most a few dozen
# sizes per weight under the CPU's batch budget, for at most ROUND_TOKENS - 1 tokens of work more.
# Queries (fewer tokens) keep their exact size: their latency is the point, and their sizes are few.
ROUND_FROM, ROUND_TOKENS = 64, 32


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
    """Op-by-op execution on the CPU: simple, exact, and the reference for the CUDA engine.

    A batch of many texts (LEARN_TOKENS tokens or more, two sequences or more) is cut at sequence
    bounds into one piece per thread (packed.split), and the pieces run at once, each on one
    thread: the calling one and `threads - 1` helpers. Each piece's forward then has no parallel
    region to share: its threads meet once, at the batch's end, instead of at the barrier of
    every op of every layer. On idle cores that beats torch's intra-op pool for such batches, and
    when other processes keep the cores busy it beats it by far: a thread that loses its core
    stalls only its own piece. Every other batch (a query, one long text) runs on one thread or on
    the pool, as worker/thread_choice.py chooses.
    """

    side_by_side = False  # one batch at a time: the lanes mix in the batcher instead
    bulk_sms = 0

    def __init__(self, model: EmbeddingModel, threads: int | None = None, adapt_threads: bool = True,
                 pieces: bool = True):
        self.model = model
        self.pooling = model.spec.pooling
        most = threads or torch.get_num_threads()
        self.threads = ThreadChoice(most, adapt_threads)
        self.pieces = most
        self.helpers = (ThreadPoolExecutor(most - 1, thread_name_prefix="pollen-piece",
                                           initializer=torch.set_num_threads, initargs=(1,))
                        if pieces and most > 1 else None)

    def submit(self, batch: PackedBatch, out=None, normalize: np.ndarray | None = None,
               lane: Lane = Lane.INTERACTIVE) -> ReadyRows:
        tokens = len(batch.ids)
        pieces = split(batch, self.pieces) if tokens >= LEARN_TOKENS and self.helpers is not None else [batch]
        if len(pieces) > 1:
            return self._answer(self._pieces_rows(pieces), out, normalize)
        threads = self.threads.threads_for(tokens)
        started = time.perf_counter()
        rows = self._rows(batch)
        self.threads.ran(threads, tokens, time.perf_counter() - started)
        return self._answer(rows, out, normalize)

    def _pieces_rows(self, pieces: list[PackedBatch]) -> torch.Tensor:
        """The pieces' pooled rows, in order: the first on this thread, the others on the helpers,
        each on one thread."""
        running = [self.helpers.submit(self._rows, piece) for piece in pieces[1:]]
        had = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            first = self._rows(pieces[0])
        finally:
            torch.set_num_threads(had)
        return torch.cat([first, *(piece.result() for piece in running)])

    def _rows(self, batch: PackedBatch) -> torch.Tensor:
        """The batch's pooled rows, float32 [rows, hidden] (before the head)."""
        t = torch.from_numpy
        if batch.tokens >= ROUND_FROM:
            batch = padded(batch, ROUND_TOKENS)
        with torch.inference_mode():  # per thread: the helpers need their own
            hidden = self.model.hidden_states(t(batch.ids), t(batch.positions), t(batch.cu_seqlens),
                                              batch.max_seqlen)
            return pool_rows(hidden, t(batch.pool_index), t(batch.pool_first), t(batch.pool_last),
                             t(batch.pool_count), self.pooling)

    def _answer(self, rows: torch.Tensor, out, normalize: np.ndarray | None) -> ReadyRows:
        t = torch.from_numpy
        with torch.inference_mode():
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
        if self.helpers is not None:
            self.helpers.shutdown()

    def warm_up(self, budget_s: float = 0.0) -> None:
        self.submit(warm_up_batch()).result()
        if self.helpers is not None:  # the helpers' first calls too: a batch that is cut in pieces
            self.submit(pack([np.arange(1, 65, dtype=np.int32)] * (LEARN_TOKENS // 64))).result()


def make_engine(model: EmbeddingModel, device: str, threads: int | None = None, adapt_threads: bool = True,
                pieces: bool = True, **options) -> Engine:
    """threads, adapt_threads (worker/thread_choice.py) and pieces (EngineOptions.cpu_pieces) matter
    to the CPU engine only; options (max_batch_tokens, cuda_graphs, graph_max_tokens,
    defer_capture, bulk_sms, interactive_step) to the CUDA engine only."""
    if device.startswith("cuda"):
        from pollen.worker.cuda_engine import CudaEngine

        return CudaEngine(model, device, **options)
    return EagerEngine(model, threads, adapt_threads, pieces)
