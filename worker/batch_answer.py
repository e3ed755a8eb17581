"""One batch's answer record (BATCH_RESULT, drawn in shared_mem/records.py): planned when the
batch is launched, filled in when it is done.

The plan is made before the model runs because the record's space is held in the response ring
at launch, and the engine copies the batch's pooled rows straight into its raw area: so its size
must be known then, and it is. Which requests this batch completes, how many rows each has here,
their dims and encodings all come with the spans. The plan also says which rows the device
normalizes: those of requests whose answer is their raw rows as they are.

When the batch is done, `fill` writes the header and one entry per completed request, and the
CPU makes the answers that are not raw rows (worker/postprocess.py): Matryoshka cuts, other
encodings, chunk and CHUNK_MEAN combines, native int8, and requests that span several batches,
whose rows gather batch by batch in their Job (worker/batcher.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pollen.common.encodings import row_bytes
from pollen.shared_mem import records
from pollen.v1 import embedder_pb2 as pb
from pollen.worker.batcher import Job
from pollen.worker.postprocess import combine, finish

EARLIER_FAILURE = "the model failed on an earlier batch of this request"


@dataclass(slots=True)
class Entry:
    """A request this batch completes, and where its answer goes in the record."""

    job: Job
    direct: bool   # its answer is its raw rows, normalized on the device if asked
    body_at: int   # byte offset of its answer in the record
    body_len: int


def answered_by_raw_rows(job: Job, whole: bool, hidden: int) -> bool:
    """The common case: all its rows in this batch, each row its own output (texts, contextual
    chunks, token vectors), float32 at full size (so native int8, which needs ENCODING_INT8,
    never is)."""
    options = job.rec.options
    return whole and job.rows_are_outputs and options.encoding == pb.ENCODING_FLOAT32 and options.dims in (0, hidden)


class BatchAnswer:
    def __init__(self, spans: list[tuple[Job, int, int]], hidden: int, native_int8: bool = False,
                 batch_tokens: int | None = None):
        self.spans = spans
        self.hidden = hidden
        self.native_int8 = native_int8
        self.tokens = sum(job.tokens(a, b) for job, a, b in spans)
        # The whole batch's tokens when this is its first share (or the whole of it); 0 otherwise.
        self.batch_tokens = self.tokens if batch_tokens is None else batch_tokens
        self.seqs = sum(b - a for _, a, b in spans)
        self.first_row: list[int] = []           # per span: its first row in the raw area
        self.entry_of: list[Entry | None] = []   # per span: its entry, if this batch completes it
        rows = 0
        for job, a, b in spans:
            self.first_row.append(rows)
            rows += int(job.row_offsets[b] - job.row_offsets[a])
        self.rows = rows
        self.normalize = np.zeros(rows, dtype=np.int32)  # per row: the device normalizes it
        completed = sum(b == job.n_seqs for job, _, b in spans)
        self.raw_at = records.raw_at(completed)
        end = self.raw_at + 4 * hidden * rows
        for (job, a, b), row in zip(spans, self.first_row):
            entry, end = self.plan_entry(job, a, b, row, end) if b == job.n_seqs else (None, end)
            self.entry_of.append(entry)
        self.entries = [e for e in self.entry_of if e is not None]
        self.nbytes = end

    def plan_entry(self, job: Job, a: int, b: int, row: int, end: int) -> tuple[Entry, int]:
        """Where the answer of a request this batch completes goes; and the record's new end."""
        hidden = self.hidden
        n = int(job.row_offsets[b] - job.row_offsets[a])
        slice_at, slice_len = self.raw_at + 4 * hidden * row, 4 * hidden * n
        if answered_by_raw_rows(job, a == 0, hidden):
            self.normalize[row:row + n] = job.rec.options.normalize
            return Entry(job, True, slice_at, slice_len), end
        rec = job.rec
        length = rec.n_out * row_bytes(rec.options.dims or hidden, rec.options.encoding)
        if a == 0 and length <= slice_len:
            return Entry(job, False, slice_at, length), end  # over its own raw rows
        return Entry(job, False, end, length), end + records.align8(length)  # an area of its own

    def raw_rows(self, record: memoryview) -> np.ndarray:
        """The record's raw area as a writable float32 [rows, hidden] view: the engine's `out`."""
        return np.frombuffer(record, dtype=np.float32, count=self.rows * self.hidden,
                             offset=self.raw_at).reshape(self.rows, self.hidden)

    def fill(self, record: memoryview, error: Exception | None, start_ns: int, end_ns: int) -> list[Job]:
        """Write header, entries and CPU-made answers into the held record once the batch is done
        (its raw rows in place) or failed (`error`). Returns the requests that fail with this
        batch but that a later batch completes: they need an answer of their own."""
        records.pack_batch_header(record, self.tokens, self.seqs, self.rows, len(self.entries), self.hidden,
                                  self.batch_tokens)
        table = records.batch_entries(record, len(self.entries))
        raw = self.raw_rows(record)
        message = None  # written into the error room the first time an entry needs it
        unanswered = []
        index = 0
        for (job, a, b), row, entry in zip(self.spans, self.first_row, self.entry_of):
            rec = job.rec
            whole = a == 0 and b == job.n_seqs
            if a == 0 and not whole:  # the first of its batches
                job.first_start_ns, job.pooled, job.failed = start_ns, None, False
            if error is not None or (not whole and job.failed):
                if entry is None:
                    if not job.failed:
                        unanswered.append(job)
                    job.failed = True  # answered now (or about to be); its later spans are dropped
                    continue
                if message is None:
                    message = self.write_message(record, f"model failed on this batch: {error}"
                                                 if error is not None else EARLIER_FAILURE)
                table[index] = (rec.req_id, records.INTERNAL, 0, 0, rec.options.encoding, 0, 0, *message)
                index += 1
                continue
            rows = raw[row:row + int(job.row_offsets[b] - job.row_offsets[a])]
            if not whole:
                if job.pooled is None:
                    job.pooled = np.empty((job.n_rows, self.hidden), dtype=np.float32)
                job.pooled[job.row_offsets[a]:job.row_offsets[b]] = rows
            if entry is None:
                continue
            if not entry.direct:
                # A private copy first: an answer written over its own raw rows overwrites them.
                self.encode(job, np.array(rows) if whole else job.pooled, record, entry)
            first_start_ns = start_ns if whole else job.first_start_ns
            table[index] = (rec.req_id, records.OK, rec.n_out, rec.options.dims or self.hidden, rec.options.encoding,
                            max(0, start_ns - rec.admit_ns) // 1000, (end_ns - first_start_ns) // 1000,
                            entry.body_at, entry.body_len)
            index += 1
        return unanswered

    def encode(self, job: Job, vectors: np.ndarray, record: memoryview, entry: Entry) -> None:
        """Combine (chunks, CHUNK_MEAN), cut, normalize and encode a request's rows into its answer."""
        rec = job.rec
        if not job.rows_are_outputs:
            vectors = combine(vectors, rec.rows.out.astype(np.int64), rec.rows.weight.astype(np.float64), rec.n_out)
        options = rec.options
        finish(vectors, options.dims, options.normalize, options.encoding,
               record[entry.body_at:entry.body_at + entry.body_len], self.native_int8)

    def write_message(self, record: memoryview, text: str) -> tuple[int, int]:
        """Put a failure message into the error room; (offset, length) for the entries."""
        data = text.encode()[:records.ERROR_ROOM]
        at = records.BATCH_HEADER + len(self.entries) * records.ENTRY.itemsize
        record[at:at + len(data)] = data
        return at, len(data)
