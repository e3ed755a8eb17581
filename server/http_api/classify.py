"""POST /v1/classify: pollen's own JSON form of Classify.

    {model, input: str | [str], text_pairs?: [str], raw_scores, truncate, max_tokens, priority, timeout_ms}
    -> {id, model, data: [{index, labels: [{label, score}]}], usage}

Each text's labels come best first (softmax scores, or the logits with `raw_scores`), the texts
in the request's order. Unknown fields are refused, as /v1/embeddings refuses them.
"""
from __future__ import annotations

import uuid
from typing import Literal

import msgspec

from pollen.common.request import PRIORITY_BY_NAME, TRUNCATE_BY_NAME
from pollen.server.http_api.body import Rejected, choices, decode
from pollen.v1 import embedder_pb2 as pb


class ClassifyBody(msgspec.Struct, forbid_unknown_fields=True):
    input: str | list[str]
    model: str = ""
    text_pairs: list[str] | None = None
    raw_scores: bool = False
    truncate: Literal["none", "end", "start"] | None = None
    max_tokens: int = 0
    priority: Literal["interactive", "bulk"] = "interactive"
    timeout_ms: int = 0


_DECODER = msgspec.json.Decoder(ClassifyBody)
_CHOICES = choices(ClassifyBody)


def to_classify_request(body_bytes: bytes) -> pb.ClassifyRequest:
    """The body as a ClassifyRequest; Rejected naming the field when it cannot be."""
    body = decode(_DECODER, body_bytes, _CHOICES)
    for name in ("max_tokens", "timeout_ms"):
        if not 0 <= getattr(body, name) < 1 << 32:
            raise Rejected(f"{name} must be a count of 0 or more, got {getattr(body, name)}", name)
    message = pb.ClassifyRequest(
        texts=[body.input] if isinstance(body.input, str) else body.input, text_pairs=body.text_pairs or [],
        model=body.model, raw_scores=body.raw_scores, max_tokens=body.max_tokens,
        priority=PRIORITY_BY_NAME[body.priority], timeout_ms=body.timeout_ms, id=f"classify-{uuid.uuid4().hex}")
    if body.truncate is not None:
        message.truncate = TRUNCATE_BY_NAME[body.truncate]
    return message


def to_classify_answer(answer: pb.ClassifyResponse) -> dict:
    tokens = answer.usage.prompt_tokens
    return {"id": answer.id, "model": answer.model,
            "data": [{"index": r.index, "labels": [{"label": s.label, "score": s.score} for s in r.labels]}
                     for r in answer.results],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
