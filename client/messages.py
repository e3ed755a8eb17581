"""Options to EmbedRequest, EmbedResponse to numpy: the one place both clients share."""
from __future__ import annotations

from collections.abc import Sequence

import grpc
import numpy as np

from pollen.common import encodings, status
from pollen.v1 import embedder_pb2 as pb

_ENUMS = {
    "encoding": ("ENCODING_", pb.Encoding), "truncate": ("TRUNCATE_", pb.Truncate),
    "long_input": ("LONG_INPUT_", pb.LongInput), "priority": ("PRIORITY_", pb.Priority),
    "outputs": ("OUTPUT_", pb.Output),
}


class EmbedError(Exception):
    """The server refused or failed a request; `code` is its grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str = ""):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError, target: str = "") -> EmbedError:
        """The call's status; UNAVAILABLE names the target (no server may have answered at all)."""
        if exc.code() == grpc.StatusCode.UNAVAILABLE and target:
            return cls(exc.code(), f"no answer from {target}: {exc.details() or ''}")
        return cls(exc.code(), exc.details() or "")


class Vectors(np.ndarray):
    """Vectors as numpy rows, with the served `model` that answered them (EmbedResponse.model):
    in a server of several models a request that names none gets the first of its task."""

    model: str

    def __new__(cls, values: np.ndarray, model: str):
        array = np.asarray(values).view(cls)
        array.model = model
        return array

    def __array_finalize__(self, obj) -> None:
        self.model = getattr(obj, "model", "")


class ScaledInt8Array(Vectors):
    """int8 vectors with one scale per row (float value = int8 value * scale)."""

    scales: np.ndarray

    def __new__(cls, values: np.ndarray, scales: np.ndarray, model: str = ""):
        array = super().__new__(cls, np.asarray(values, dtype=np.int8), model)
        array.scales = np.asarray(scales, dtype=np.float32)
        return array

    def __array_finalize__(self, obj) -> None:
        super().__array_finalize__(obj)
        self.scales = getattr(obj, "scales", None)

    def dequantize(self) -> np.ndarray:
        return self.view(np.ndarray).astype(np.float32) * self.scales[:, None]


class Results(list):
    """One result per input (a text's token vectors or sparse vector, a document's rank, a
    text's label scores), with the served `model` that answered them."""

    def __init__(self, items, model: str):
        super().__init__(items)
        self.model = model


def enum_value(field: str, value) -> int:
    """"int8", "INT8" or pb.ENCODING_INT8 -> pb.ENCODING_INT8 (likewise for the other enums)."""
    prefix, enum = _ENUMS[field]
    if isinstance(value, str):
        try:
            return enum.Value(prefix + value.upper())
        except ValueError:
            names = ", ".join(n[len(prefix):].lower() for n in enum.keys())
            raise ValueError(f"{field}={value!r} is not one of: {names}") from None
    return int(value)


def build_request(texts: str | Sequence[str], *, dimensions: int = 0, normalize: bool = True,
                  encoding="float32", truncate=None, max_tokens: int = 0, prompt_name: str = "",
                  prompt: str = "", long_input="truncate", priority="interactive", timeout_ms: int = 0,
                  request_id: str = "", outputs: Sequence = ("dense",), sparse_top_k: int | None = None,
                  sparse_tokens: bool = False, model: str = "") -> pb.EmbedRequest:
    """An EmbedRequest for texts (one string is one text) to the served `model` (empty: the
    server's first embedder). Enums take names or pb values; truncate None leaves it unset, for
    the server's --default-truncate. outputs names the dense vectors unless told otherwise, so
    that a model which answers none (SPLADE) refuses the request instead of answering no rows."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    request = pb.EmbedRequest(
        id=request_id, texts=texts, dimensions=dimensions or 0, normalize=normalize, model=model,
        encoding=enum_value("encoding", encoding), max_tokens=max_tokens, prompt_name=prompt_name, prompt=prompt,
        long_input=enum_value("long_input", long_input), priority=enum_value("priority", priority),
        timeout_ms=timeout_ms, outputs=[enum_value("outputs", o) for o in outputs], sparse_tokens=sparse_tokens)
    if truncate is not None:
        request.truncate = enum_value("truncate", truncate)
    if sparse_top_k is not None:
        request.sparse_top_k = sparse_top_k
    return request


def classify_request(texts: str | Sequence[str], text_pairs: Sequence[str] | None = None, *, truncate=None,
                     priority="interactive", **options) -> pb.ClassifyRequest:
    """A ClassifyRequest for texts (one string is one text) and their pairs; enums take names or
    pb values, truncate None leaves it unset (the server cuts a text's end)."""
    request = pb.ClassifyRequest(texts=[texts] if isinstance(texts, str) else list(texts),
                                 text_pairs=list(text_pairs or ()), priority=enum_value("priority", priority),
                                 **options)
    if truncate is not None:
        request.truncate = enum_value("truncate", truncate)
    return request


def label_scores(reply: pb.ClassifyResponse, sent: int) -> Results:
    """Each result's {label: score}, best first."""
    answered(reply, len(reply.results), sent, "results")
    return Results([{s.label: s.score for s in result.labels} for result in reply.results], reply.model)


def ranks(reply: pb.RerankResponse, documents: int, top_n: int | None) -> Results:
    """(index, score) of each ranked document, best first."""
    answered(reply, len(reply.results), documents if top_n is None else min(top_n, documents), "ranks", "documents")
    return Results([(r.index, r.score) for r in reply.results], reply.model)


def auth_metadata(api_key: str | None) -> tuple | None:
    """The gRPC metadata that presents `api_key` (as the server's --api-key wants it), or None."""
    if api_key is None:
        return None
    if not api_key or not all(33 <= ord(c) <= 126 for c in api_key):
        raise ValueError("api_key must be non-empty printable ASCII without spaces")
    return (("authorization", f"Bearer {api_key}"),)


def answered(response, count: int, sent: int, what: str, inputs: str = "texts") -> None:
    """An answer holds one result per input sent. One that holds another count (none, say: what a
    dense decoder reads in a SPLADE model's answer to a request that names no outputs) is an
    error, never a shorter list."""
    if count != sent:
        raise EmbedError(grpc.StatusCode.INTERNAL,
                         f"model {response.model or '(unnamed)'} answered {count} {what} for {sent} {inputs}",
                         response.id)


def _refused(response: pb.EmbedResponse) -> None:
    if response.HasField("error"):
        raise EmbedError(status.code_of(response.error.code), response.error.message, response.id)


def decode(response: pb.EmbedResponse, sent: int | None = None) -> Vectors:
    """The answer's rows: float32/float16 as they are, bfloat16 widened to float32 (exactly),
    int8 as a ScaledInt8Array, ubinary as packed uint8 rows (least-significant bit first);
    `sent`: the texts asked, which the rows must number."""
    _refused(response)
    if sent is not None:
        answered(response, response.rows, sent, "dense vectors")
    if response.encoding not in encodings.DTYPES:
        raise ValueError(f"unknown encoding {response.encoding} in the answer")
    rows = encodings.rows_of(response.embeddings, response.rows, response.dims, response.encoding)
    if response.encoding == pb.ENCODING_BFLOAT16:
        return Vectors(encodings.widen_bfloat16(rows), response.model)
    if response.encoding == pb.ENCODING_INT8:
        return ScaledInt8Array(rows, list(response.scales), response.model)
    return Vectors(rows.copy(), response.model)


def decode_tokens(response: pb.EmbedResponse, sent: int) -> list[np.ndarray]:
    """The answer's token vectors (outputs OUTPUT_TOKENS): a float32 [tokens, dims] array per text."""
    _refused(response)
    answered(response, len(response.token_counts), sent, "texts' token vectors")
    return [rows.copy() for rows in encodings.ragged(response.token_embeddings, np.float32, response.token_counts,
                                                      response.dims)]


def decode_sparse(response: pb.EmbedResponse, sent: int, tokens: bool = False) -> list[tuple]:
    """The answer's sparse vectors (outputs OUTPUT_SPARSE): (ids uint32 ascending, weights float32)
    per text, and with `tokens` (asked with sparse_tokens) each id's vocabulary string, a list third."""
    _refused(response)
    answered(response, len(response.sparse_counts), sent, "sparse vectors")
    ids = encodings.ragged(response.sparse_indices, np.uint32, response.sparse_counts)
    weights = encodings.ragged(response.sparse_values, np.float32, response.sparse_counts)
    if not tokens:
        return [(i.copy(), w.copy()) for i, w in zip(ids, weights)]
    cuts = np.cumsum([0, *response.sparse_counts]).tolist()
    strings = list(response.sparse_tokens)
    return [(i.copy(), w.copy(), strings[a:b]) for i, w, a, b in zip(ids, weights, cuts, cuts[1:])]


def concatenate(parts: list[Vectors]) -> Vectors:
    """The pieces' rows as one answer, under the first piece's model."""
    if len(parts) == 1:
        return parts[0]
    rows = np.concatenate([p.view(np.ndarray) for p in parts])
    if isinstance(parts[0], ScaledInt8Array):
        return ScaledInt8Array(rows, np.concatenate([p.scales for p in parts]), parts[0].model)
    return Vectors(rows, parts[0].model)


def split(texts: str | Sequence[str], limit: int) -> list[list[str]]:
    """Texts in pieces of at most `limit` (the server's max_texts_per_request)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("no texts to embed")
    return [texts[i:i + limit] for i in range(0, len(texts), limit)]
