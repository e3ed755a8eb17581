"""POST /v1/rerank and /v2/rerank in the shape Cohere's and Jina's rerank APIs share:

    {model, query, documents: [str | {text}], top_n, return_documents, max_tokens_per_doc}
    -> {id, model, results: [{index, relevance_score, document?: {text}}], usage, meta}

plus pollen's own `instruction` (Qwen3-Reranker), `raw_scores`, `truncate`, `max_tokens` (per
pair), `priority` and `timeout_ms`. Results are sorted by score, best first; a top_n past the
count returns every document, as Cohere does. Fields the body has beyond these are ignored, as
clients of those APIs send some of their own (Cohere's `rank_fields`, say).
"""
from __future__ import annotations

import uuid
from typing import Literal

import msgspec

from pollen.common.request import PRIORITY_BY_NAME, TRUNCATE_BY_NAME
from pollen.server.http_api.body import Rejected, choices, decode
from pollen.v1 import embedder_pb2 as pb


class DocumentObject(msgspec.Struct):
    text: str


class RerankBody(msgspec.Struct):
    query: str
    documents: list[str | DocumentObject]
    model: str = ""
    top_n: int | None = None
    return_documents: bool = False
    max_tokens_per_doc: int | None = None
    instruction: str = ""
    raw_scores: bool = False
    truncate: Literal["none", "end"] | None = None
    max_tokens: int = 0
    priority: Literal["interactive", "bulk"] = "interactive"
    timeout_ms: int = 0


_DECODER = msgspec.json.Decoder(RerankBody)
_CHOICES = choices(RerankBody)


def to_rerank_request(body_bytes: bytes) -> pb.RerankRequest:
    """The body as a RerankRequest; Rejected naming the field when it cannot be."""
    body = decode(_DECODER, body_bytes, _CHOICES)
    for name in ("top_n", "max_tokens_per_doc", "max_tokens", "timeout_ms"):
        value = getattr(body, name)
        if value is not None and not 0 <= value < 1 << 32:
            raise Rejected(f"{name} must be a count of 0 or more, got {value}", name)
    if body.max_tokens_per_doc == 0:
        raise Rejected("max_tokens_per_doc must be at least 1 (leave it out for no bound)", "max_tokens_per_doc")
    message = pb.RerankRequest(
        query=body.query, documents=[d if isinstance(d, str) else d.text for d in body.documents],
        model=body.model, return_documents=body.return_documents, instruction=body.instruction,
        raw_scores=body.raw_scores, max_tokens=body.max_tokens, max_document_tokens=body.max_tokens_per_doc or 0,
        priority=PRIORITY_BY_NAME[body.priority], timeout_ms=body.timeout_ms, id=f"rerank-{uuid.uuid4().hex}")
    if body.top_n is not None:
        message.top_n = body.top_n
    if body.truncate is not None:
        message.truncate = TRUNCATE_BY_NAME[body.truncate]
    return message


def to_rerank_answer(answer: pb.RerankResponse, request: pb.RerankRequest) -> dict:
    results = []
    for r in answer.results:
        item = {"index": r.index, "relevance_score": r.score}
        if request.return_documents:
            item["document"] = {"text": r.document}
        results.append(item)
    tokens = answer.usage.prompt_tokens
    return {"id": answer.id, "model": answer.model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "meta": {"billed_units": {"search_units": 1, "input_tokens": tokens}}}
