"""The CUDA engine: packed batches through whole-model CUDA graphs, with CPU work hidden under GPU work.

One batch's life (batch N+1 is submitted before batch N's result is awaited):

    CPU   pack ids/positions/index arrays and the per-row normalize flags into a pinned host
          slot (numpy, compact layout)
    copy  stream: one H2D copy of that slot into a device staging slot, then an event (inputs of
          a few hundred bytes, i.e. queries, skip this hop and go straight to the compute stream)
    GPU   compute stream waits on the event, copies staging -> the static inputs (one D2D),
          replays the graph captured for the batch's bucket (or runs eagerly): the forward,
          pooling, and L2 normalization of the flagged rows (a reranker's or classifier's head
          instead); then copies the rows D2H straight into the caller's `out` (the batch's
          records in the response rings, memory the worker registered with CUDA, so the copy is
          a true asynchronous DMA), records an event. On the
          interactive lane the small copies (inputs up, rows down) call the CUDA runtime
          directly (worker/cudart.py), which costs a lone query less host time than torch's copy_
    CPU   LazyTensor.result() waits on that event: the bytes are in the ring

Two lanes, each its own CUDA stream, pinned slots, device inputs and graphs, so an interactive
batch never queues behind a bulk one: INTERACTIVE runs on a high-priority stream (the GPU
schedules its kernels' blocks ahead of the bulk lane's as SMs free up), BULK on a low-priority
one, confined by default to a share of the SMs (worker/sm_partition.py, `--bulk-sms`), so that a
query's kernels find SMs free instead of waiting for bulk blocks to leave. Both replay graphs: an
eager forward costs the worker's one thread milliseconds of kernel launches, during which an
interactive request that arrives would wait.

Each lane's graphs are captured into that lane's memory pool (so memory grows with the largest
bucket used, not with the number of buckets; the lanes run at once, so they cannot share one).
A bucket is (tokens, sequences, longest sequence, rows), each rounded up: flash attention's grid
grows with the sequence count and the longest sequence, so both are part of the key, and the rows
the pooling writes (one a text, or a chunk, or a token for token vectors) have their own count, at
least the sequences'. Padding tokens form one extra sequence pooled into a discarded row; padding
sequences are empty, and so are padding rows. Capture happens in `warm_up` (the likely query
buckets, then the likely document buckets, within a time budget, before the worker says READY),
and for a bucket first met under load either at once (`defer_capture=False`: the batch waits for
its capture) or later: the batch runs now in the smallest captured graph of the lane that holds it
with at most twice its tokens (`covering`: padding costs GPU time, less than eager launches cost
the worker), or eagerly if there is none, and the bucket is captured between batches
(`between_batches`):
- while no interactive work waits or runs, any bucket a batch missed (so a steady bulk stream,
  which never leaves the worker idle, gets its graphs too) and no client waits for a capture;
- under interactive load, which may never pause, a bucket that ran eagerly
  CAPTURE_UNDER_LOAD_HITS times: interactive launches wait while that lane's batches in flight
  finish, the capture runs, launches go on. At most one such capture per
  CAPTURE_UNDER_LOAD_EVERY_NS and each bucket once (the set is finite): a bounded pause of the
  interactive lane instead of eager batches for as long as the load lasts.
`counts` says how batches ran (shared_mem/server_state.py, GRAPH_COUNTS).
"""
from __future__ import annotations

import bisect
import mmap
import sys
import time

import numpy as np
import torch

from pollen.common import defaults
from pollen.common.request import LANES, Lane
from pollen.worker import cudart
from pollen.worker.lazy import LazyTensor
from pollen.worker.models import fp8
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.pooling import pool_rows
from pollen.worker.packed import ONE_TEXT_SHARED_MAX, PackedBatch, warm_up_batch
from pollen.worker.sm_partition import BulkPartition, bulk_sm_count, green_contexts_supported

# A graph's padded shape: (tokens, sequences, longest sequence, rows).
Bucket = tuple[int, int, int, int]
CAPTURE_UNDER_LOAD_HITS = 8  # eager batches of a bucket that earn it a capture under load
CAPTURE_UNDER_LOAD_EVERY_NS = 1_000_000_000  # at most one capture under load per this long


def token_buckets(limit: int) -> list[int]:
    """16, 32, 48, 64, ... growing by about a quarter each step (so padding wastes at most a fifth), up to limit."""
    out, size = [], 16
    while size < limit:
        out.append(size)
        size = max(size + 16, (size * 5 // 4 + 15) // 16 * 16)
    out.append(limit)
    return out


def check_row_buffers(parts: list[np.ndarray], shape: torch.Size) -> None:
    """Raw copies check what copy_ would: C-contiguous float32 buffers of the rows' width, no
    more rows in all than there are."""
    for part in parts:
        if not (part.flags.c_contiguous and part.dtype == np.float32 and part.shape[1:] == shape[1:]):
            raise ValueError(f"out buffers must be C-contiguous float32 [n, {shape[1]}], not {part.dtype} {part.shape}")
    if sum(len(part) for part in parts) > shape[0]:
        raise ValueError(f"out buffers hold {sum(len(part) for part in parts)} rows; the batch has {shape[0]}")


def pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


class DeviceLane:
    """One lane's stream (of its priority, or from the lane's SM partition), double-buffered
    pinned slots, staging and inputs."""

    SLOTS = 2  # double buffering: batch N+1 fills one slot while batch N's copies use the other

    def __init__(self, device: torch.device, cap: int, priority: int, partition: BulkPartition | None = None):
        self.partition = partition  # None: a plain stream of `priority`
        if partition is None:
            self.stream = torch.cuda.Stream(device, priority=priority)
            self.copy_stream = torch.cuda.Stream(device, priority=priority)
        else:
            self.stream, self.copy_stream = partition.stream(), partition.stream()
        self.host_in = [torch.empty(cap, dtype=torch.int32, pin_memory=True) for _ in range(self.SLOTS)]
        self.host_np = [slot.numpy() for slot in self.host_in]  # the same memory, viewed once
        self.staging = [torch.empty(cap, dtype=torch.int32, device=device) for _ in range(self.SLOTS)]
        self.staged = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self.done = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self.static_in = torch.zeros(cap, dtype=torch.int32, device=device)
        self.slot = 0
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # Buckets met under load, to capture later, by how many batches ran: eagerly (wanted), or
        # padded into a larger graph (padded).
        self.wanted: dict[Bucket, int] = {}
        self.padded: dict[Bucket, int] = {}

    def next_slot(self) -> int:
        slot = self.slot
        self.slot = (slot + 1) % self.SLOTS
        return slot


class CudaEngine:
    side_by_side = True  # the lanes run at once, on streams of two priorities
    COPY_STREAM_MIN = 4096  # int32 values; smaller inputs skip the copy stream (see upload)

    def __init__(self, model: EmbeddingModel, device: str, max_batch_tokens: int = 0,
                 cuda_graphs: bool = True, graph_max_tokens: int | None = None, defer_capture: bool = False,
                 bulk_sms: int = 0, interactive_step: int = 0):
        self.model = model
        self.device = torch.device(device)
        max_batch_tokens = max_batch_tokens or defaults.batch_tokens(device, 0, model.spec.max_tokens)
        self.pooling = model.spec.pooling
        self.hidden = model.spec.output_dims  # the width of the rows written: pooled, or a head's
        # float32 attention takes a per-sequence loop that reads cu_seqlens on the host (see
        # worker/models/attention.py): it cannot be captured, so float32 runs eagerly, and so does
        # any model whose forward reads the device on the host (EmbeddingModel.host_syncs).
        self.graphs_on = (cuda_graphs and next(model.parameters()).dtype != torch.float32
                          and not model.host_syncs)
        self.buckets = token_buckets(min(graph_max_tokens or max_batch_tokens, max_batch_tokens))
        fp8.align(model, self.buckets)  # with fp8 products: the same ones eager and in a bucket's graph
        self.max_positions = model.spec.max_tokens
        # Compact int32 layout of one batch: ids, positions, pool_index [T]; cu [S+1]; first, last,
        # count, normalize [R]. Rows never exceed tokens + 1 and sequences never exceed tokens + 1
        # (the padding sequence).
        cap = 8 * max_batch_tokens + 16
        low, high = torch.cuda.Stream.priority_range()
        # The bulk lane on a share of the SMs (worker/sm_partition.py); 0: every SM.
        total = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.bulk_sms = bulk_sm_count(bulk_sms, total, green_contexts_supported())
        partition = None
        if self.bulk_sms:
            try:
                partition = BulkPartition.shared(self.device, self.bulk_sms)
            except RuntimeError as exc:  # the default asks only where torch has the API; a driver may still refuse
                if bulk_sms > 0:
                    raise
                print(f"pollen: no CUDA green context of {self.bulk_sms} SMs ({exc}); the bulk lane uses every SM",
                      file=sys.stderr, flush=True)
                self.bulk_sms = 0
        # interactive_step lowers the interactive lane's priority by that many steps, never to the
        # bulk lane's (worker/main.py: a reranker beside an embedder, whose queries go first).
        interactive = min(high + interactive_step, low - 1) if high < low else high
        self.lanes = (DeviceLane(self.device, cap, interactive), DeviceLane(self.device, cap, low, partition))
        # The interactive lane's small copies skip torch's copy_ (worker/cudart.py); None: copy_ throughout.
        self.runtime = cudart.find()
        self.registered: list[int] = []  # host addresses we page-locked (register_host_memory)
        self.defer_capture = defer_capture
        self.capture_seconds = 0.0
        # GRAPH_COUNTS: batches of a graph-sized bucket that ran eagerly (no graph held them), batches
        # run padded in a larger graph than their own bucket's, and graphs held on both lanes.
        self.counts = np.zeros(3, dtype=np.uint64)
        self.capture_pending = False  # interactive launches wait for a capture under load
        self.next_load_capture_ns = 0
        # A lone query's bucket and its pinned layout less its ids and normalize flag, by its length
        # and bucket (see fill_one_text). Bounded: ONE_TEXT_SHARED_MAX lengths, each with its own
        # bucket, and a layout for each bucket it runs in (its own, or a larger captured graph that
        # covers it: at most one per graph of the interactive lane).
        self.one_text_buckets: dict[int, Bucket] = {}
        self.one_text_layouts: dict[tuple[Bucket, int], np.ndarray] = {}

    @property
    def graphs(self) -> dict:
        """The interactive lane's graphs, by bucket."""
        return self.lanes[Lane.INTERACTIVE].graphs

    @property
    def wanted(self) -> dict:
        """Buckets the interactive lane met under load and ran eagerly, to capture when idle."""
        return self.lanes[Lane.INTERACTIVE].wanted

    @property
    def padded(self) -> dict:
        """Buckets the interactive lane met under load and ran padded in a larger graph, to capture when idle."""
        return self.lanes[Lane.INTERACTIVE].padded

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
        """(tokens, sequences, longest, rows) of the graph that runs this batch, or None for eager."""
        if not self.graphs_on or batch.tokens > self.buckets[-1]:
            return None
        n = batch.tokens
        # A lone query, the common latency-bound case: its bucket depends on its length alone (one
        # sequence, one row). Not one_text(), whose pooled-span check costs a numpy read here.
        if self.lone_sequence(batch):
            shape = self.one_text_buckets.get(n)
            if shape is None:
                shape = self.one_text_buckets[n] = self.bucket_of(n, 1, 1, n)
            return shape
        return self.bucket_of(batch.tokens, len(batch.cu_seqlens) - 1, batch.rows, batch.max_seqlen)

    def bucket_of(self, tokens: int, seqs: int, rows: int, longest: int) -> Bucket:
        padded = self.buckets[bisect.bisect_left(self.buckets, tokens)]
        pad = padded > tokens
        seqs = min(pow2_at_least(seqs + pad, 2), padded + 1)
        # Rows have a bucket of their own (a row holds a token at least), never below the
        # sequences': token vectors make a row of every token, and as sequence slots those rows
        # would hand the attention kernel thousands of empty sequences, most of its time for
        # such a batch.
        rows = max(seqs, min(pow2_at_least(rows, 2), padded))
        bucket_longest = max(min(pow2_at_least(longest, 16), padded, self.max_positions), longest)
        return padded, seqs, bucket_longest, rows

    def fill(self, host: torch.Tensor, batch: PackedBatch, shape, normalize: np.ndarray | None = None) -> int:
        """Write the batch and its per-row normalize flags into a pinned slot in the layout of
        `shape` (padded); return its length."""
        arr = host if isinstance(host, np.ndarray) else host.numpy()
        if shape is not None and self.one_text(batch):
            return self.fill_one_text(arr, batch, shape, normalize)
        return self.fill_general(arr, batch, shape, normalize)

    def fill_general(self, arr: np.ndarray, batch: PackedBatch, shape, normalize: np.ndarray | None) -> int:
        if shape is None:
            tokens, seqs, rows = batch.tokens, len(batch.cu_seqlens) - 1, batch.rows
        else:
            tokens, seqs, _, rows = shape
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

    @staticmethod
    def lone_sequence(batch: PackedBatch) -> bool:
        """A batch of one sequence of a query's length, pooled into one row."""
        return batch.tokens <= ONE_TEXT_SHARED_MAX and batch.rows == 1 and len(batch.cu_seqlens) == 2

    @classmethod
    def one_text(cls, batch: PackedBatch) -> bool:
        """A lone sequence pooled over all its tokens (not a chunk of it)."""
        return cls.lone_sequence(batch) and int(batch.pool_count[0]) == batch.tokens

    def fill_one_text(self, arr: np.ndarray, batch: PackedBatch, shape, normalize: np.ndarray | None) -> int:
        """fill() for one text: everything in its padded layout but the ids and the normalize flag
        depends on its length and bucket alone, so it is laid out once (by fill_general) and copied
        instead of the general fill's dozen small numpy writes before its GPU work starts."""
        n = batch.tokens
        layout = self.one_text_layouts.get((shape, n))
        if layout is None:
            scratch = np.empty(len(arr), dtype=np.int32)
            used = self.fill_general(scratch, batch, shape, None)
            layout = self.one_text_layouts[(shape, n)] = scratch[:used].copy()
        used = len(layout)
        arr[:used] = layout
        arr[:n] = batch.ids
        arr[used - shape[3]] = 0 if normalize is None else normalize[0]  # norm [rows]: the last array, row 0
        return used

    # ---------------------------------------------------------------- running

    def forward(self, inputs: list[torch.Tensor], longest: int) -> torch.Tensor:
        ids, pos, index, cu, first, last, count, norm = inputs
        hidden = self.model.hidden_states(ids, pos, cu, longest)
        # The head (if any) is part of the graph, after pooling (EmbeddingModel.output_rows).
        return self.model.output_rows(pool_rows(hidden, index, first, last, count, self.pooling), norm)

    def capture(self, shape, lane_index: Lane = Lane.INTERACTIVE) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture a lane's graph for `shape`, on its stream. Its inputs are the lane's static
        inputs laid out as `shape`; they hold a valid padded batch (see fill) before the warm-up
        run, so no index in them points out of bounds."""
        lane = self.lanes[lane_index]
        start = time.perf_counter()
        slot = lane.next_slot()
        lane.staged[slot].synchronize()
        used = self.fill(lane.host_in[slot], warm_up_batch(), shape)
        inputs, _ = self.views(lane.static_in, shape[0], shape[1], shape[3])
        with torch.cuda.stream(lane.stream):
            lane.static_in[:used].copy_(lane.host_in[slot][:used], non_blocking=True)
            lane.staged[slot].record(lane.stream)
            self.forward(inputs, shape[2])  # warm-up outside the graph: lazy inits, autotuning
        lane.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than torch.cuda.graph(), which synchronizes the whole device
        # and empties the allocator's cache first: the bulk lane may be running beside us.
        with torch.cuda.stream(lane.stream):
            graph.capture_begin(pool=lane.pool)
            try:
                out = self.forward(inputs, shape[2])
            finally:
                graph.capture_end()
        self.keep(lane_index, shape, (graph, out))
        self.capture_seconds += time.perf_counter() - start
        return graph, out

    def submit(self, batch: PackedBatch, out=None, normalize: np.ndarray | None = None,
               lane: Lane = Lane.INTERACTIVE) -> LazyTensor:
        """Start a batch on a lane (INTERACTIVE: high priority; BULK: low priority)."""
        if torch.is_inference_mode_enabled():  # the worker runs its whole loop in it
            return self._submit(batch, out, normalize, lane)
        with torch.inference_mode():
            return self._submit(batch, out, normalize, lane)

    def _submit(self, batch: PackedBatch, out, normalize: np.ndarray | None, lane_index: int) -> LazyTensor:
        lane = self.lanes[lane_index]
        shape = self.bucket(batch)
        graph = lane.graphs.get(shape) if shape is not None else None
        if shape is not None and graph is None:
            if not self.defer_capture:
                graph = self.capture(shape, lane_index)
            elif (cover := self.covering(lane, shape, batch, self.model)) is not None:
                lane.padded[shape] = lane.padded.get(shape, 0) + 1  # captured when the lane idles
                self.counts[1] += 1
                shape, graph = cover, lane.graphs[cover]
            else:
                lane.wanted[shape] = lane.wanted.get(shape, 0) + 1  # captured later (between_batches)
                self.counts[0] += 1
                shape = None
        slot = lane.next_slot()
        lane.staged[slot].synchronize()  # the copy that last read this pinned slot is done
        used = self.fill(lane.host_np[slot], batch, shape, normalize)
        torch.cuda.set_stream(lane.stream)  # the worker's one thread works on this lane's stream
        try:
            result = self.run_on_lane(lane, slot, used, batch, graph, out)
        finally:
            if lane.partition is not None:
                # Never leave a green context's stream current, not even when the launch raised:
                # memory freed at exit asks the current stream whether it is capturing, and that
                # stream's context may be gone by then.
                torch.cuda.set_stream(self.lanes[Lane.INTERACTIVE].stream)
        done = lane.done[slot]  # reusable: this slot's previous result was read before we got here
        done.record(lane.stream)
        return LazyTensor(result, done)

    @staticmethod
    def covering(lane: DeviceLane, shape: Bucket, batch: PackedBatch,
                 model: EmbeddingModel | None = None) -> Bucket | None:
        """The smallest of the lane's captured graphs that can run `batch` (of bucket `shape`, not
        captured) padded, with at most twice the bucket's tokens; None if there is none. It needs as
        many sequences as the batch plus its padding sequence (and rows), and as long a longest
        sequence; the padding sequence may be longer than that, as in any bucket (its rows are
        discarded, see fill). With fp8 products, the graph must take the products the bucket
        takes (worker/models/fp8.py, same_products)."""
        tokens, _, longest, _ = shape
        seqs = len(batch.cu_seqlens) - 1
        best = None
        for key in lane.graphs:
            t, s, longest_key, r = key
            if (tokens <= t <= 2 * tokens and longest_key >= longest and s >= seqs + (t > batch.tokens)
                    and r >= batch.rows and (model is None or fp8.same_products(model, tokens, t))
                    and (best is None or key < best)):
                best = key
        return best

    def keep(self, lane_index: Lane, shape: Bucket, graph) -> None:
        """A graph captured for `shape` on a lane: its batches stop running eagerly or padded."""
        lane = self.lanes[lane_index]
        self.counts[2] += shape not in lane.graphs
        lane.graphs[shape] = graph
        lane.wanted.pop(shape, None)
        lane.padded.pop(shape, None)

    def keep_counts_in(self, counts: np.ndarray) -> None:
        """Add its counts to `counts` and count there from now on (a worker with several models
        gives every engine the same array: the figures are the worker's)."""
        counts += self.counts
        self.counts = counts

    def run_on_lane(self, lane: DeviceLane, slot: int, used: int, batch: PackedBatch, graph, out):
        """Upload, run (replay the graph, or eagerly) and start the copy of the rows out, on the
        lane's stream (the current one); the result tensor or buffers the rows land in."""
        self.upload(lane, slot, used)
        if graph is None:
            inputs, _ = self.views(lane.static_in, batch.tokens, len(batch.cu_seqlens) - 1, batch.rows)
            rows = self.forward(inputs, batch.max_seqlen)
        else:
            graph[0].replay()
            rows = graph[1]
        if out is None:  # tests, tools and the bulk lane: a pinned buffer of the caching host allocator
            result = torch.empty(batch.rows, self.hidden, dtype=torch.float32, pin_memory=True)
            result.copy_(rows[:batch.rows], non_blocking=True)
            return result
        parts = out if isinstance(out, list) else [out]
        if self.direct(lane) and rows.dtype == torch.float32 and rows.is_contiguous():
            # The response rings, registered: each part's DMA lands in its answer record itself.
            check_row_buffers(parts, rows.shape)
            at, row_bytes, stream = rows.data_ptr(), rows.stride(0) * 4, lane.stream.cuda_stream
            for part in parts:
                self.runtime.memcpy_async(part.ctypes.data, at, part.nbytes, cudart.DEVICE_TO_HOST, stream)
                at += len(part) * row_bytes
            return out
        at = 0
        for part in parts:
            torch.from_numpy(part).copy_(rows[at:at + len(part)], non_blocking=True)
            at += len(part)
        return out

    def direct(self, lane: DeviceLane) -> bool:
        """Whether this lane's small copies go straight to the runtime: the interactive lane's,
        where a query waits on them. A green context's streams keep torch's copy_."""
        return self.runtime is not None and lane.partition is None

    def upload(self, lane: DeviceLane, slot: int, used: int) -> None:
        """The pinned slot's inputs into the lane's static inputs, on the lane's stream."""
        if used > self.COPY_STREAM_MIN:
            # A sizeable input goes up on the copy stream, beside whatever the GPU still runs; the
            # compute stream then takes it with one device-to-device copy.
            with torch.cuda.stream(lane.copy_stream):
                lane.staging[slot][:used].copy_(lane.host_in[slot][:used], non_blocking=True)
                lane.staged[slot].record(lane.copy_stream)
            lane.stream.wait_event(lane.staged[slot])
            lane.static_in[:used].copy_(lane.staging[slot][:used], non_blocking=True)
        else:
            # A query's few hundred bytes: one copy on the compute stream costs less than a stream hop.
            if self.direct(lane):
                self.runtime.memcpy_async(lane.static_in.data_ptr(), lane.host_in[slot].data_ptr(), used * 4,
                                          cudart.HOST_TO_DEVICE, lane.stream.cuda_stream)
            else:
                lane.static_in[:used].copy_(lane.host_in[slot][:used], non_blocking=True)
            lane.staged[slot].record(lane.stream)

    def most_wanted(self, min_hits: int):
        """The interactive lane's bucket that the most batches ran eagerly in, if at least
        `min_hits` did; else None."""
        wanted = self.lanes[Lane.INTERACTIVE].wanted
        shape = max(wanted, key=wanted.get, default=None)
        return shape if shape is not None and wanted[shape] >= min_hits else None

    def between_batches(self, interactive_waiting: bool, interactive_in_flight: bool, now_ns: int) -> bool:
        """Capture a bucket a batch missed, as the module docstring says; True while interactive
        launches wait for a capture under load."""
        if not interactive_waiting and not interactive_in_flight:
            self.capture_pending = False
            self.capture_one()
            return False
        if not self.capture_pending:
            self.capture_pending = (now_ns >= self.next_load_capture_ns
                                    and self.most_wanted(CAPTURE_UNDER_LOAD_HITS) is not None)
        if self.capture_pending and not interactive_in_flight:
            self.capture_one(CAPTURE_UNDER_LOAD_HITS)
            self.capture_pending = False
            self.next_load_capture_ns = time.monotonic_ns() + CAPTURE_UNDER_LOAD_EVERY_NS
        return self.capture_pending

    def capture_one(self, min_hits: int = 0) -> bool:
        """Capture one bucket a batch met under load (it ran eagerly or padded), the interactive
        lane's first; False if none waits. Called when no interactive batch is in flight (a bulk
        batch may run: the capture waits for the bulk lane's stream). With `min_hits`, only the
        interactive lane's most met bucket, if met at least that often (under load)."""
        if min_hits:
            shape, lane_index = self.most_wanted(min_hits), Lane.INTERACTIVE
        else:  # buckets that ran eagerly first, then those that ran padded; the interactive lane's first
            missed = [(lane.wanted, i) for i, lane in enumerate(self.lanes)]
            missed += [(lane.padded, i) for i, lane in enumerate(self.lanes)]
            shape, lane_index = next(((next(iter(met)), i) for met, i in missed if met), (None, None))
        if shape is None:
            return False
        with torch.inference_mode():
            self.capture(shape, lane_index)
        return True

    def register_host_memory(self, address: int, nbytes: int) -> None:
        """Page-lock memory we did not allocate (a response ring's mapping), so that copies into
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

    def warm_up(self, budget_s: float = 0.0) -> None:
        """Load kernels and allocator state before READY (one eager batch on each lane), then
        capture the likely query buckets, most likely first, for up to `budget_s` seconds."""
        graphs, self.graphs_on = self.graphs_on, False
        try:
            for lane in LANES:
                self.submit(warm_up_batch(), lane=lane).result()
        finally:
            self.graphs_on = graphs
        if not self.graphs_on or budget_s <= 0:
            return
        deadline = time.perf_counter() + budget_s
        likely = [(shape, Lane.INTERACTIVE) for shape in self.query_buckets()]
        likely += [(shape, Lane.BULK) for shape in self.document_buckets()]
        with torch.inference_mode():
            for shape, lane in likely:
                if time.perf_counter() > deadline:
                    break
                if shape not in self.lanes[lane].graphs:
                    self.capture(shape, lane)

    def query_buckets(self) -> list[Bucket]:
        """The buckets batches of short texts (queries) meet, in the order a growing load meets
        them: n texts of 8 to 24 tokens (the longest up to 64), for n = 1 up to the budget."""
        seen: dict[Bucket, None] = {}
        n = 1
        while n * 8 <= self.buckets[-1]:
            for mean in (12, 8, 16, 24):
                tokens = n * mean
                if tokens > self.buckets[-1]:
                    continue
                for longest in (32, 16, 64):
                    if longest >= mean:
                        seen.setdefault(self.bucket_of(tokens, n, n, min(longest, tokens)), None)
            n = n + 1 if n < 16 else n + max(1, n // 8)
        return list(seen)

    def document_buckets(self) -> list[Bucket]:
        """The buckets full batches of documents meet (bulk work): the largest token bucket, with
        texts of about 128 to 2,048 tokens, the longest up to twice the mean."""
        tokens = self.buckets[-1]
        seen: dict[Bucket, None] = {}
        for mean in (256, 512, 128, 1024, 2048):
            for longest in (2 * mean, mean, 4 * mean):
                if mean <= tokens and longest <= self.max_positions:
                    n = max(1, tokens // mean)  # a batch just short of the budget: a padding sequence too
                    seen.setdefault(self.bucket_of(tokens - 1, n, n, min(longest, tokens - 1)), None)
        return list(seen)
