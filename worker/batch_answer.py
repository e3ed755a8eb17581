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
whose rows gather in `job.pooled` batch by batch.
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
    """The common case: all its rows in this batch, one row per output, float32 at full size
    (so native int8, which needs ENCODING_INT8, never is)."""
    rec = job.rec
    return whole and rec.rows is None and rec.encoding == pb.ENCODING_FLOAT32 and rec.dims in (0, hidden)


class BatchAnswer:
    def __init__(self, spans: list[tuple[Job, int, int]], hidden: int, native_int8: bool = False):
        self.spans = spans
        self.hidden = hidden
        self.native_int8 = native_int8
        self.tokens = sum(job.tokens(a, b) for job, a, b in spans)
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
            if b != job.n_seqs:
                self.entry_of.append(None)
                continue
            n = int(job.row_offsets[b] - job.row_offsets[a])
            slice_at, slice_len = self.raw_at + 4 * hidden * row, 4 * hidden * n
            if answered_by_raw_rows(job, a == 0, hidden):
                entry = Entry(job, True, slice_at, slice_len)
                self.normalize[row:row + n] = job.rec.normalize
            else:
                rec = job.rec
                length = rec.n_out * row_bytes(rec.dims or hidden, rec.encoding)
                if a == 0 and length <= slice_len:
                    entry = Entry(job, False, slice_at, length)  # over its own raw rows
                else:  # it began in an earlier batch: an area of its own
                    entry = Entry(job, False, end, length)
                    end += records.align8(length)
            self.entry_of.append(entry)
        self.entries = [e for e in self.entry_of if e is not None]
        self.nbytes = end

    def raw_rows(self, record: memoryview) -> np.ndarray:
        """The record's raw area as a writable float32 [rows, hidden] view: the engine's `out`."""
        return np.frombuffer(record, dtype=np.float32, count=self.rows * self.hidden,
                             offset=self.raw_at).reshape(self.rows, self.hidden)

    def fill(self, record: memoryview, error: Exception | None, start_ns: int, end_ns: int) -> list[Job]:
        """Write header, entries and CPU-made answers into the held record once the batch is done
        (its raw rows in place) or failed (`error`). Returns the requests that fail with this
        batch but that a later batch completes: they need an answer of their own."""
        records.pack_batch_header(record, self.tokens, self.seqs, self.rows, len(self.entries), self.hidden)
        table = records.batch_entries(record, len(self.entries))
        raw = self.raw_rows(record)
        message = None  # written into the error room the first time an entry needs it
        unanswered = []
        index = 0
        for (job, a, b), row, entry in zip(self.spans, self.first_row, self.entry_of):
            rec = job.rec
            if job.first_start_ns == 0:
                job.first_start_ns = start_ns
            job.last_start_ns, job.last_end_ns = start_ns, end_ns
            failed = error is not None or job.done_seqs < 0
            if failed and entry is None:
                if job.done_seqs >= 0:
                    unanswered.append(job)
                job.done_seqs = -1  # answered (or about to be); its later spans are dropped
                continue
            if failed:
                if message is None:
                    message = self.write_message(record, f"model failed on this batch: {error}"
                                                 if error is not None else EARLIER_FAILURE)
                job.done_seqs = -1
                table[index] = (rec.req_id, records.INTERNAL, 0, 0, rec.encoding, 0, 0, *message)
                index += 1
                continue
            n = int(job.row_offsets[b] - job.row_offsets[a])
            rows = raw[row:row + n]
            whole = a == 0 and b == job.n_seqs
            if not whole:
                if job.pooled is None:
                    job.pooled = np.empty((job.n_rows, self.hidden), dtype=np.float32)
                job.pooled[job.row_offsets[a]:job.row_offsets[b]] = rows
            job.done_seqs += b - a
            if entry is None:
                continue
            dims = rec.dims or self.hidden
            if not entry.direct:
                # A private copy first: an answer written over its own raw rows overwrites them.
                vectors = np.array(rows) if whole else job.pooled
                if rec.rows is not None:  # contextual chunks (weights 1) or CHUNK_MEAN windows
                    vectors = combine(vectors, rec.rows.out.astype(np.int64), rec.rows.weight.astype(np.float64),
                                      rec.n_out)
                finish(vectors, rec.dims, rec.normalize, rec.encoding,
                       record[entry.body_at:entry.body_at + entry.body_len], self.native_int8)
            table[index] = (rec.req_id, records.OK, rec.n_out, dims, rec.encoding,
                            max(0, job.last_start_ns - rec.admit_ns) // 1000,
                            (job.last_end_ns - job.first_start_ns) // 1000, entry.body_at, entry.body_len)
            index += 1
        return unanswered

    def write_message(self, record: memoryview, text: str) -> tuple[int, int]:
        """Put a failure message into the error room; (offset, length) for the entries."""
        data = text.encode()[:records.ERROR_ROOM]
        at = records.BATCH_HEADER + len(self.entries) * records.ENTRY.itemsize
        record[at:at + len(data)] = data
        return at, len(data)
