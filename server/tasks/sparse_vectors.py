"""Sparse vectors (`outputs: OUTPUT_SPARSE`) from a SPLADE model's answer rows.

The worker writes each row as the model's SPARSE_TERMS largest vocabulary weights (largest first)
then their ids as float32 (worker/models/heads.py SparseHead). A row keeps its positive weights,
at most the request's sparse_top_k of them (the largest), in ascending id order. Weights are raw:
normalization does not apply to sparse rows. A row holds at most --sparse-max-terms entries (1,024
unless set; the vocabulary where that is smaller): a request's answer at most texts x that many ids
and weights. A text with that many positive weights or more may have had some cut, so a request
that did not ask for the largest (sparse_top_k) is refused saying so, rather than answered with
fewer weights than the model gives. BGE-M3's sparse vectors come from its own
rows (server/tasks/bge_m3.py). With sparse_tokens, each id's vocabulary string comes beside it.
"""
from __future__ import annotations

import numpy as np

from pollen.common.errors import invalid
from pollen.common.model_spec import ModelSpec
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.shared_mem import records
from pollen.v1 import embedder_pb2 as pb


def answer_fields(request: pb.EmbedRequest, spec: ModelSpec, result: records.ResultRecord) -> dict:
    """An EmbedResponse's sparse vectors from a SPLADE model's rows."""
    rows = np.frombuffer(result.body, np.float32).reshape(result.rows, result.dims)
    if not request.sparse_top_k and spec.sparse_terms < spec.vocab_size:
        full = np.flatnonzero(rows[:, spec.sparse_terms - 1] > 0)  # rows sorted largest first
        if len(full):
            terms = spec.sparse_terms
            raise invalid(f"texts[{full[0]}] has {terms:,} or more positive vocabulary weights, the most an answer "
                          f"row holds (the server's --sparse-max-terms {terms}): set sparse_top_k to at most "
                          f"{terms} for the largest, or serve with --sparse-max-terms up to the vocabulary's "
                          f"{spec.vocab_size:,}")
    ids, weights, counts = finish(rows, spec.sparse_terms, request.sparse_top_k)
    return {"encoding": pb.ENCODING_FLOAT32, "sparse_indices": ids.tobytes(), "sparse_values": weights.tobytes(),
            "sparse_counts": counts}


def finish(rows: np.ndarray, terms: int, top_k: int = 0) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(ids uint32, weights float32, entries per row) from the worker's [R, 2 x terms] rows."""
    ids, weights, counts = [], [], []
    for row in rows:
        values = row[:terms]
        keep = int(np.count_nonzero(values > 0))  # sorted largest first: the positives lead
        if top_k:
            keep = min(keep, top_k)
        order = np.argsort(row[terms:terms + keep], kind="stable")
        ids.append(row[terms:terms + keep][order].astype(np.uint32))
        weights.append(values[:keep][order].astype(np.float32))
        counts.append(keep)
    return (np.concatenate(ids) if ids else np.zeros(0, np.uint32),
            np.concatenate(weights) if weights else np.zeros(0, np.float32), counts)


def token_strings(tokenizer: TextTokenizer, indices: bytes) -> list[str]:
    """sparse_tokens: the vocabulary's string of each id of an answer's sparse_indices (uint32),
    as the tokenizer's id_to_token gives it."""
    to_token = tokenizer.tokenizer.id_to_token
    return [to_token(i) or "" for i in np.frombuffer(indices, np.uint32).tolist()]
