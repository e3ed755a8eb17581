"""The CUDA engine: packed batches through whole-model CUDA graphs, with CPU work hidden under GPU work.

One batch's life (batch N+1 is submitted before batch N's result is awaited):

    CPU   pack ids/positions/index arrays and the per-row normalize flags into a pinned host
          slot (numpy, compact layout)
    copy  stream: one H2D copy of that slot into a device staging slot, then an event (inputs of
          a few hundred bytes, i.e. queries, skip this hop and go straight to the compute stream)
    GPU   compute stream waits on the event, copies staging -> the graph's static inputs (one D2D),
          replays the graph captured for the batch's bucket (or runs eagerly above the largest):
          the forward, pooling, and L2 normalization of the flagged rows; then copies the rows D2H
          straight into the caller's `out` (the batch's record in the response ring, memory the
          worker registered with CUDA, so the copy is a true asynchronous DMA), records an event
    CPU   Pending.result() waits on that event (a LazyTensor): the bytes are in the ring

Graphs are captured lazily, on the first batch that needs a bucket, into one shared memory pool
(so memory grows with the largest bucket used, not with the number of buckets). A bucket is
(tokens, sequences, longest sequence), each rounded up: flash attention's grid grows with the
sequence count and the longest sequence, so both are part of the key. Padding tokens form one
extra sequence pooled into a discarded row; padding sequences are empty.
"""
from __future__ import annotations

import bisect
import mmap
import time

import numpy as np
import torch

from pollen.worker.lazy import LazyTensor
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.pooling import normalize_rows, pool_rows
from pollen.worker.packed import PackedBatch, warm_up_batch


def token_buckets(limit: int) -> list[int]:
    """16, 32, 48, 64, ... growing by about 1/4 each step (so padding wastes at most ~20%), up to limit."""
    out, size = [], 16
    while size < limit:
        out.append(size)
        size = max(size + 16, (size * 5 // 4 + 15) // 16 * 16)
    out.append(limit)
    return out


def pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


class Pending:
    __slots__ = ("lazy",)

    def __init__(self, lazy: LazyTensor):
        self.lazy = lazy

    def done(self) -> bool:
        return self.lazy.ready()

    def result(self):
        """Wait for the D2H copies; the rows they wrote (the caller's `out`, or the engine's own)."""
        value = self.lazy.wait()
        return value.numpy() if isinstance(value, torch.Tensor) else value


class CudaEngine:
    SLOTS = 2  # double buffering: batch N+1 fills one slot while batch N's copies use the other
    COPY_STREAM_MIN = 4096  # int32 values; smaller inputs skip the copy stream (see _submit)

    def __init__(self, model: EmbeddingModel, device: str, max_batch_tokens: int = 16384,
                 cuda_graphs: bool = True, graph_max_tokens: int | None = None):
        self.model = model
        self.device = torch.device(device)
        self.pooling = model.spec.pooling
        self.hidden = model.spec.hidden_size
        # float32 attention takes a per-sequence loop that reads cu_seqlens on the host (see
        # worker/models/attention.py): it cannot be captured, so float32 runs eagerly.
        self.graphs_on = cuda_graphs and next(model.parameters()).dtype != torch.float32
        self.buckets = token_buckets(min(graph_max_tokens or max_batch_tokens, max_batch_tokens))
        self.max_positions = model.spec.max_tokens
        self.stream = torch.cuda.Stream(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        # Compact int32 layout of one batch: ids, positions, pool_index [T]; cu [S+1]; first, last,
        # count, normalize [R]. Rows never exceed tokens + 1 and sequences never exceed tokens + 1
        # (the padding sequence).
        cap = 8 * max_batch_tokens + 16
        self.host_in = [torch.empty(cap, dtype=torch.int32, pin_memory=True) for _ in range(self.SLOTS)]
        self.staging = [torch.empty(cap, dtype=torch.int32, device=self.device) for _ in range(self.SLOTS)]
        self.staged = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self.done = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self.static_in = torch.zeros(cap, dtype=torch.int32, device=self.device)
        self.registered: list[int] = []  # host addresses we page-locked (register_host_memory)
        self.slot = 0
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_seconds = 0.0

    # ---------------------------------------------------------------- layout

    @staticmethod
    def views(buf: torch.Tensor, tokens: int, seqs: int, rows: int):
        """The eight arrays of a (tokens, seqs, rows)-shaped batch inside a flat int32 buffer."""
        t, s, r = tokens, seqs + 1, rows
        parts = (t, t, t, s, r, r, r, r)
        out, at = [], 0
        for n in parts:
            out.append(buf[at:at + n])
            at += n
        return out, at

    def bucket(self, batch: PackedBatch):
        """(tokens, sequences, longest) of the graph that runs this batch, or None for eager."""
        if not self.graphs_on or batch.tokens > self.buckets[-1]:
            return None
        tokens = self.buckets[bisect.bisect_left(self.buckets, batch.tokens)]
        pad = tokens > batch.tokens
        seqs = min(pow2_at_least(max(len(batch.cu_seqlens) - 1 + pad, batch.rows), 2), tokens + 1)
        longest = min(pow2_at_least(batch.max_seqlen, 16), tokens, self.max_positions)
        longest = max(longest, batch.max_seqlen)
        return tokens, seqs, longest

    def fill(self, host: torch.Tensor, batch: PackedBatch, shape, normalize: np.ndarray | None = None) -> int:
        """Write the batch and its per-row normalize flags into a pinned slot in the layout of
        `shape` (padded); return its length."""
        if shape is None:
            tokens, seqs, rows = batch.tokens, len(batch.cu_seqlens) - 1, batch.rows
        else:
            tokens, seqs, _ = shape
            rows = seqs
        arr = host.numpy()
        (ids, pos, index, cu, first, last, count, norm), used = self.views(arr, tokens, seqs, rows)
        n, b, r = batch.tokens, len(batch.cu_seqlens), batch.rows
        ids[:n], pos[:n], index[:n] = batch.ids, batch.positions, batch.pool_index
        # Tokens pooled nowhere point at row `rows` (the discarded extra row), also in padding.
        index[:n][batch.pool_index >= r] = rows
        ids[n:], pos[n:], index[n:] = 0, 0, rows
        cu[:b] = batch.cu_seqlens
        cu[b:] = tokens  # the padding sequence [n, tokens), then empty ones
        first[:r], last[:r], count[:r] = batch.pool_first, batch.pool_last, batch.pool_count
        first[r:], last[r:], count[r:] = 0, 0, 1
        norm[:r] = 0 if normalize is None else normalize
        norm[r:] = 0
        return used

    # ---------------------------------------------------------------- running

    def forward(self, inputs: list[torch.Tensor], longest: int) -> torch.Tensor:
        ids, pos, index, cu, first, last, count, norm = inputs
        hidden = self.model.hidden_states(ids, pos, cu, longest)
        return normalize_rows(pool_rows(hidden, index, first, last, count, self.pooling), norm)

    def graph_for(self, shape):
        graph = self.graphs.get(shape)
        if graph is None:
            inputs, _ = self.views(self.static_in, shape[0], shape[1], shape[1])
            start = time.perf_counter()
            with torch.cuda.stream(self.stream):
                self.forward(inputs, shape[2])  # warm-up outside the graph: lazy inits, autotuning
            self.stream.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                out = self.forward(inputs, shape[2])
            graph = self.graphs[shape] = (g, out)
            self.capture_seconds += time.perf_counter() - start
        return graph

    def submit(self, batch: PackedBatch, out: np.ndarray | None = None, normalize: np.ndarray | None = None) -> Pending:
        with torch.inference_mode():
            return self._submit(batch, out, normalize)

    def _submit(self, batch: PackedBatch, out: np.ndarray | None, normalize: np.ndarray | None) -> Pending:
        slot = self.slot
        self.slot = (slot + 1) % self.SLOTS
        shape = self.bucket(batch)
        self.staged[slot].synchronize()  # the copy that last read this pinned slot is done
        used = self.fill(self.host_in[slot], batch, shape, normalize)
        torch.cuda.set_stream(self.stream)  # the worker's one thread works on our stream
        if used > self.COPY_STREAM_MIN:
            # A sizeable input goes up on the copy stream, beside whatever the GPU still runs; the
            # compute stream then takes it with one device-to-device copy.
            with torch.cuda.stream(self.copy_stream):
                self.staging[slot][:used].copy_(self.host_in[slot][:used], non_blocking=True)
                self.staged[slot].record(self.copy_stream)
            self.stream.wait_event(self.staged[slot])
            self.static_in[:used].copy_(self.staging[slot][:used], non_blocking=True)
        else:
            # A query's few hundred bytes: one copy on the compute stream costs less than a stream hop.
            self.static_in[:used].copy_(self.host_in[slot][:used], non_blocking=True)
            self.staged[slot].record(self.stream)
        if shape is None:
            inputs, _ = self.views(self.static_in, batch.tokens, len(batch.cu_seqlens) - 1, batch.rows)
            rows = self.forward(inputs, batch.max_seqlen)
        else:
            graph, rows = self.graph_for(shape)
            graph.replay()
        if out is None:  # tests and tools: a pinned buffer of the caching host allocator
            result = torch.empty(batch.rows, self.hidden, dtype=torch.float32, pin_memory=True)
            result.copy_(rows[:batch.rows], non_blocking=True)
        else:  # the response rings, registered: each part's DMA lands in its answer record itself
            result, at = out, 0
            for part in out if isinstance(out, list) else [out]:
                torch.from_numpy(part).copy_(rows[at:at + len(part)], non_blocking=True)
                at += len(part)
        done = self.done[slot]  # reusable: this slot's previous result was read before we got here
        done.record(self.stream)
        return Pending(LazyTensor(result, done))

    def register_host_memory(self, address: int, nbytes: int) -> None:
        """Page-lock memory we did not allocate (the response ring's mapping), so that copies into
        it are asynchronous DMA rather than a staged, blocking copy. Undone by close()."""
        page = mmap.PAGESIZE  # whole pages: the mapping's last page is ours to its end
        nbytes = -(-nbytes // page) * page
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed with cudaError {err}")
        self.registered.append(address)

    def unregister_host_memory(self, address: int) -> None:
        """Undo register_host_memory (before the memory is unmapped), once copies into it are done."""
        if address in self.registered:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(address)
            self.registered.remove(address)

    def close(self) -> None:
        """Wait for copies in flight, then unregister the host memory (before it is unmapped)."""
        if self.registered:
            torch.cuda.synchronize(self.device)
        while self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.registered.pop())

    def warm_up(self) -> None:
        """Load kernels and allocator state before READY; graphs stay lazy (captured on first use)."""
        graphs, self.graphs_on = self.graphs_on, False
        try:
            self.submit(warm_up_batch()).result()
        finally:
            self.graphs_on = graphs
