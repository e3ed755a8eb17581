"""BGE-M3's answers (common/model_spec.py, ModelSpec.bge_m3) from one forward pass: the worker's
raw rows, one per token (server/tasks/token_vectors.py's row plan), each [h | normalize(colbert_linear(h))
| relu(sparse_linear(h))] of that token's last hidden state h (worker/models/bge_m3.py). What each
output takes from them is what FlagEmbedding's BGEM3FlagModel computes:

- dense: the first token's h (the <s> token: CLS pooling), cut to `dimensions` and normalized
  when asked, as any dense vector;
- sparse: each token's weight (the row's last value); per token id the largest over the id's
  positions, the ids of spec.sparse_skip_ids (cls, eos, pad, unk) left out and only positive
  weights kept; then at most sparse_top_k of them (the largest), in ascending id order. Raw:
  never normalized;
- ColBERT (outputs OUTPUT_TOKENS): colbert_linear(h) of every token after the first (the last
  </s> included), n - 1 vectors for n tokens (token_counts say so), always L2-normalized, as the
  model's ColBERT vectors are: the worker normalized them; cut to `dimensions`, they are
  normalized again.

A request for dense vectors alone never comes here: its rows are the texts' pooled ones, whose
first hidden_size values the worker cuts like any Matryoshka prefix (server/pipeline/admission.py).
"""
from __future__ import annotations

import numpy as np

from pollen.common.model_spec import ModelSpec
from pollen.server.pipeline.outputs import Outputs
from pollen.server.tasks.token_vectors import shape
from pollen.shared_mem import records
from pollen.v1 import embedder_pb2 as pb


def answer_fields(request: pb.EmbedRequest, spec: ModelSpec, seqs: list, result: records.ResultRecord,
                  wanted: Outputs) -> dict:
    """An EmbedResponse's vectors from the worker's token rows (one per token of `seqs`)."""
    hidden = spec.hidden_size
    rows = np.frombuffer(result.body, np.float32).reshape(result.rows, result.dims)
    first = np.cumsum([0, *(len(s) for s in seqs[:-1])])  # each text's first row
    fields: dict = {"encoding": pb.ENCODING_FLOAT32}
    if wanted.dense:
        dense = shape(rows[first, :hidden], request.dimensions, request.normalize)
        fields |= {"embeddings": dense.tobytes(), "rows": len(dense), "dims": dense.shape[1]}
    if wanted.tokens:
        after_first = np.ones(len(rows), dtype=bool)
        after_first[first] = False
        # The worker normalized them: only a dimensions cut is normalized again.
        colbert = shape(rows[after_first, hidden:2 * hidden], request.dimensions, 0 < request.dimensions < hidden)
        fields |= {"token_embeddings": colbert.tobytes(), "token_counts": [len(s) - 1 for s in seqs],
                   "dims": colbert.shape[1]}
    if wanted.sparse:
        ids, weights, counts = sparse(rows[:, 2 * hidden], seqs, spec.sparse_skip_ids, request.sparse_top_k)
        fields |= {"sparse_indices": ids.tobytes(), "sparse_values": weights.tobytes(), "sparse_counts": counts}
    return fields


def sparse(weights: np.ndarray, seqs: list, skip: tuple, top_k: int = 0) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(ids uint32, weights float32, entries per text) from each token's weight (`weights`, one per
    token of `seqs` in order): per text, each id's largest positive weight, `skip` ids left out, at
    most top_k entries (0: all), ids ascending."""
    all_ids, all_weights, counts = [], [], []
    at = 0
    for seq in seqs:
        ids = np.asarray(seq, dtype=np.int64)
        w = weights[at:at + len(ids)]
        at += len(ids)
        keep = (w > 0) & ~np.isin(ids, skip)
        unique, where = np.unique(ids[keep], return_inverse=True)  # ascending ids
        best = np.zeros(len(unique), dtype=np.float32)
        np.maximum.at(best, where, w[keep])
        if top_k and len(unique) > top_k:
            largest = np.sort(np.argsort(-best, kind="stable")[:top_k])
            unique, best = unique[largest], best[largest]
        all_ids.append(unique.astype(np.uint32))
        all_weights.append(best)
        counts.append(len(unique))
    return (np.concatenate(all_ids) if all_ids else np.zeros(0, np.uint32),
            np.concatenate(all_weights) if all_weights else np.zeros(0, np.float32), counts)
