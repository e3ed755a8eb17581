"""What an EmbedRequest asks for (`outputs`), checked against the request and the model: dense
vectors, token vectors (server/tasks/token_vectors.py), sparse vectors (server/tasks/sparse_vectors.py).

A dense model answers dense and token vectors; a sparse (SPLADE) model answers sparse vectors
only, and a request to it that lists no outputs gets them; BGE-M3 answers any subset of the three
(server/tasks/bge_m3.py), dense by default. Every refusal names `outputs` or the option that does not
apply: sparse_top_k and sparse_tokens go with sparse vectors only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pollen.common.errors import invalid
from pollen.common.model_spec import ModelSpec
from pollen.shared_mem.records import RowPlan
from pollen.v1 import embedder_pb2 as pb

_OUTPUTS = set(pb.Output.values())
_NAMES = {pb.OUTPUT_DENSE: "OUTPUT_DENSE", pb.OUTPUT_SPARSE: "OUTPUT_SPARSE", pb.OUTPUT_TOKENS: "OUTPUT_TOKENS"}


@dataclass(frozen=True, slots=True)
class Outputs:
    dense: bool
    tokens: bool
    sparse: bool


DENSE = Outputs(dense=True, tokens=False, sparse=False)


def wanted(request: pb.EmbedRequest, spec: ModelSpec) -> Outputs:
    if not (request.outputs or spec.sparse_terms or request.sparse_tokens or request.HasField("sparse_top_k")):
        return DENSE  # the plain request: a dense embedder's vectors, nothing else asked
    outputs = set(request.outputs)
    unknown = outputs - _OUTPUTS
    if unknown:
        raise invalid(f"outputs holds {min(unknown)}, not a known Output value")
    if request.HasField("sparse_top_k") and request.sparse_top_k == 0:
        raise invalid("sparse_top_k must be at least 1 (leave it unset for every weight)")
    if spec.sparse_terms:
        if request.sparse_top_k > spec.sparse_terms:
            raise invalid(f"sparse_top_k {request.sparse_top_k} is over the {spec.sparse_terms} weights an answer row "
                          f"holds (the server's --sparse-max-terms)")
        asked = _sparse(request, spec, outputs - {pb.OUTPUT_UNSPECIFIED} or {pb.OUTPUT_SPARSE})
    else:
        asked = _dense(request, spec, outputs)
    if not asked.sparse:
        if request.HasField("sparse_top_k"):
            raise invalid("sparse_top_k applies to outputs OUTPUT_SPARSE only")
        if request.sparse_tokens:
            raise invalid("sparse_tokens applies to outputs OUTPUT_SPARSE only (it names the vocabulary "
                          "tokens beside a sparse vector's ids); ask outputs OUTPUT_SPARSE or leave it false")
    return asked


def _dense(request: pb.EmbedRequest, spec: ModelSpec, outputs: set) -> Outputs:
    """A dense embedder's outputs (BGE-M3's sparse vectors among them)."""
    sparse = pb.OUTPUT_SPARSE in outputs
    if sparse and not spec.bge_m3:
        raise invalid(f"outputs OUTPUT_SPARSE needs a model with a sparse head (SPLADE or BGE-M3); {spec.name} "
                      "answers dense vectors and token vectors only")
    tokens = pb.OUTPUT_TOKENS in outputs
    if tokens and spec.dense:
        raise invalid(f"outputs OUTPUT_TOKENS is not served for {spec.name}: its vectors pass through "
                      "sentence-transformers Dense modules, which apply to pooled vectors, not to tokens")
    dense = not outputs or bool(outputs & {pb.OUTPUT_DENSE, pb.OUTPUT_UNSPECIFIED})
    if tokens or sparse:
        _one_sequence_a_text(request, "OUTPUT_TOKENS" if tokens else "OUTPUT_SPARSE")
        if not (dense or tokens) and request.dimensions:
            raise invalid("dimensions does not apply to sparse vectors: leave it 0")
    return Outputs(dense=dense, tokens=tokens, sparse=sparse)


def _sparse(request: pb.EmbedRequest, spec: ModelSpec, outputs: set) -> Outputs:
    other = sorted(_NAMES[o] for o in outputs - {pb.OUTPUT_SPARSE})
    if other:
        raise invalid(f"outputs {', '.join(other)} is not served for {spec.name}: a sparse (SPLADE) model answers "
                      "outputs OUTPUT_SPARSE only")
    if request.dimensions:
        raise invalid("dimensions does not apply to sparse vectors: leave it 0")
    _one_sequence_a_text(request, "OUTPUT_SPARSE")
    return Outputs(dense=False, tokens=False, sparse=True)


def _one_sequence_a_text(request: pb.EmbedRequest, output: str) -> None:
    if request.chunks or request.long_input == pb.LONG_INPUT_CHUNK_MEAN:
        raise invalid(f"outputs {output} applies to texts and token_ids, not to chunks or "
                      "long_input LONG_INPUT_CHUNK_MEAN")
    if request.encoding != pb.ENCODING_FLOAT32:
        raise invalid(f"outputs {output} answers float32 values: leave encoding ENCODING_FLOAT32")


@dataclass(frozen=True, slots=True)
class TokenLimits:
    """The bounds of outputs OUTPUT_TOKENS (server/tasks/token_vectors.py)."""

    per_request: int  # --max-token-vectors
    per_text: int     # rows one answer record carries at the model's width


def token_rows(seqs: list, limits: TokenLimits, output: str = "OUTPUT_TOKENS") -> RowPlan:
    """Every token of every sequence a row and an output of its own, in order; refused past the
    bounds, naming `output` (what asked for the rows)."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    total = int(lengths.sum())
    if total > limits.per_request:
        raise invalid(f"outputs {output}: the request's texts hold {total} tokens, over the server's "
                      f"--max-token-vectors of {limits.per_request}; split the request")
    longest = int(lengths.argmax())
    if lengths[longest] > limits.per_text:
        raise invalid(f"outputs {output}: text {longest} has {lengths[longest]} tokens, over the "
                      f"{limits.per_text} token vectors one answer carries (--response-ring-bytes); shorten it")
    seq = np.repeat(np.arange(len(seqs), dtype=np.uint32), lengths)
    start = (np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)).astype(np.uint32)
    return RowPlan(seq, start, start + 1, np.arange(total, dtype=np.uint32), np.ones(total, np.float32))
