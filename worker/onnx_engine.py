"""The ONNX Runtime CPU engine: a model's export (worker/export.py) run by ONNX Runtime's CPU kernels.

It takes the batches the batcher packs, like the torch engine, and spreads them over the threads
the same way (worker/cpu_engine.py: a batch of many texts in pieces, one thread each; any other on
one thread or on all, as worker/thread_choice.py measures). Each piece, or batch, runs as groups
of sequences of similar length, each right-padded to its longest (worker/padded.py), the export's
input; its rows are pooled from the padded output in numpy, then go through the model's head or
Dense modules (head.onnx) and, for an embedder, the flagged ones are L2-normalized
(worker/postprocess.py, normalize_rows): what the torch engine writes, to float32 rounding.

Two sessions of the encoder serve the two thread counts: one on a single thread (the pieces run in
it at once, one call per thread, which ONNX Runtime allows) and one with an intra-op pool of every
worker thread. ONNX Runtime fixes a session's pool when it is made, so a count cannot be chosen
per call. Each session holds the weights in the form its kernels take, and keeps the largest
batch's activations in its arena: the batch budget (--max-batch-tokens) bounds those. The pool's
threads sleep when a parallel region ends, unless EngineOptions.onnx_spin.

Nothing here imports torch.
"""
from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort

from pollen.common.model_spec import ModelSpec
from pollen.common.onnx_cache import ENCODER_FILE, HEAD_FILE
from pollen.worker import padded
from pollen.worker.cpu_engine import CpuEngine
from pollen.worker.packed import PackedBatch
from pollen.worker.postprocess import normalize_rows


def session(file: str, threads: int, spin: bool = False) -> ort.InferenceSession:
    """An InferenceSession on the CPU with an intra-op pool of `threads` (the caller's thread
    among them) whose threads spin after a parallel region only with `spin` (EngineOptions.onnx_spin),
    every graph optimization on (ONNX Runtime fuses the LayerNorms, GELUs and bias additions at
    load), no memory patterns, and its log held to errors."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # A memory pattern is planned and kept for every input shape, and padded groups come in
    # thousands of shapes: that map would grow without bound. The arena reuses its blocks anyway.
    options.enable_mem_pattern = False
    options.log_severity_level = 3
    return ort.InferenceSession(file, options, providers=["CPUExecutionProvider"])


class OnnxEngine(CpuEngine):
    """ONNX Runtime on the CPU, from the export in `folder` of the model `spec` describes."""

    def __init__(self, spec: ModelSpec, folder: str, threads: int, adapt_threads: bool = True, pieces: bool = True,
                 spin: bool = False):
        super().__init__(threads, adapt_threads, pieces)
        self.spec, self.folder = spec, folder
        encoder = os.path.join(folder, ENCODER_FILE)
        counts = {threads} | ({1} if adapt_threads or pieces else set())
        self.encoders = {count: session(encoder, count, spin) for count in sorted(counts)}
        head = os.path.join(folder, HEAD_FILE)
        self.head = session(head, 1) if os.path.exists(head) else None
        # An embedder's rows are normalized where flagged; a head's (scores, sparse terms) never
        # are (EmbeddingModel.output_rows).
        self.normalizes = spec.task == "embed" and not spec.sparse_terms and not spec.bge_m3
        self.width = self.encoders[threads].get_outputs()[0].shape[-1]

    def _rows(self, batch: PackedBatch, threads: int) -> np.ndarray:
        """The batch's pooled rows, float32 [rows, width], on the session of `threads` threads."""
        encoder = self.encoders[threads]
        rows = np.empty((batch.rows, self.width), np.float32)
        for group in padded.groups(batch):
            hidden = encoder.run(None, {"input_ids": group.ids, "lengths": group.lengths})[0]
            rows[group.rows] = padded.pool(hidden, group.starts, group.counts, self.spec.pooling)
        return rows

    def _join(self, parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts)

    def _output(self, rows: np.ndarray, normalize: np.ndarray | None) -> np.ndarray:
        if self.head is not None:
            rows = self.head.run(None, {"pooled": rows})[0]
        if self.normalizes and normalize is not None:
            rows = normalize_rows(rows, normalize)
        return rows

    def weights_bytes(self) -> int:
        """The export's files on disk (its weights, and the graph)."""
        return sum(os.path.getsize(os.path.join(self.folder, name)) for name in os.listdir(self.folder))
