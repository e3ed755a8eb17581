"""Per-token vectors (`outputs: OUTPUT_TOKENS`): the last hidden state of every token of every text,
special tokens included, and with them the dense vector from the same forward pass.

They ride on the row plan that contextual chunks use (shared_mem/records.py; admission makes it:
server/pipeline/outputs.py `token_rows`): each token is a row of its own, a span of one token, so
the worker pools it to itself and answers it as it is, on both engines and through the graphs,
with no code of its own. The worker is asked for the
raw rows (full width, not normalized); the frontend then makes the answer: the dense vector is
the model's pooling over the text's token rows (mean, first or last: what the worker would have
pooled), then every vector is cut to `dimensions` and normalized as asked, in the order the worker
does it. Models whose rows pass through sentence-transformers Dense modules are refused
(server/pipeline/outputs.py): their token vectors would be a different thing from their dense ones.
BGE-M3 rides on the same plan for its ColBERT and sparse vectors, its rows wider by its heads'
outputs; server/tasks/bge_m3.py makes its answers.

Bounds (`token_rows`): at most --max-token-vectors token vectors in one request, and in one text at most the
rows one answer record carries (a text's rows are never split: the response ring's record, by
the model's row width, output_dims).
"""
from __future__ import annotations

import numpy as np

from pollen.common.model_spec import ModelSpec
from pollen.shared_mem import records
from pollen.v1 import embedder_pb2 as pb


def answer_fields(request: pb.EmbedRequest, spec: ModelSpec, seqs: list, result: records.ResultRecord,
                  dense: bool) -> dict:
    """An EmbedResponse's vectors from the worker's raw token rows (one per token of `seqs`)."""
    counts = [len(s) for s in seqs]
    raw = np.frombuffer(result.body, np.float32).reshape(result.rows, result.dims)
    pooled, rows = finish(raw, counts, spec.pooling, request.dimensions, request.normalize, dense)
    return {"embeddings": b"" if pooled is None else pooled.tobytes(), "rows": 0 if pooled is None else len(pooled),
            "dims": rows.shape[1], "encoding": pb.ENCODING_FLOAT32, "token_embeddings": rows.tobytes(),
            "token_counts": counts}


def finish(rows: np.ndarray, counts: list[int], pooling: str, dims: int, normalize: bool,
           dense: bool) -> tuple[np.ndarray | None, np.ndarray]:
    """The answer from the worker's raw token rows (float32, counts[i] of them for text i): the
    dense rows (None unless asked) and the token rows, each cut to `dims` (0: all) and normalized
    when asked."""
    bounds = np.cumsum([0, *counts])
    pooled = None
    if dense:
        pick = {"mean": lambda r: r.mean(axis=0, dtype=np.float64), "cls": lambda r: r[0], "last": lambda r: r[-1]}
        pooled = np.stack([pick[pooling](rows[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]).astype(np.float32)
        pooled = shape(pooled, dims, normalize)
    return pooled, shape(rows, dims, normalize)


def shape(rows: np.ndarray, dims: int, normalize: bool) -> np.ndarray:
    """Cut, then normalize (x / max(|x|, 1e-12), as the worker does)."""
    if dims:
        rows = rows[:, :dims]
    if normalize:
        norms = np.linalg.norm(rows, axis=1, keepdims=True).clip(min=1e-12)
        rows = rows / norms
    return np.ascontiguousarray(rows, dtype=np.float32)
