"""Check an EmbedRequest against the model and the limits; turn it into token-id sequences.

Every refusal names the field and the problem, so a client can fix its request from the message.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc
import numpy as np

from pollen.v1 import embedder_pb2 as pb
from server.errors import RequestError, invalid
from server.tokenizer import TextTokenizer
from worker.models.spec import ModelSpec
from worker.postprocess import SUPPORTED

_ENCODINGS = set(pb.Encoding.values())
_TRUNCATES = set(pb.Truncate.values())


@dataclass(slots=True)
class Admitted:
    seqs: list[np.ndarray]
    dims: int          # 0 = full
    normalize: bool
    encoding: int

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs)


class Admission:
    def __init__(self, spec: ModelSpec, tokenizer: TextTokenizer, executor: Executor, max_texts: int):
        self.spec = spec
        self.tokenizer = tokenizer
        self.executor = executor
        self.max_texts = max_texts

    def check_count(self, inputs: int) -> None:
        if inputs > self.max_texts:
            raise invalid(f"{inputs} inputs in one request, over the limit of {self.max_texts}; split the request")

    def check_truncate(self, truncate: int) -> None:
        if truncate not in _TRUNCATES:
            raise invalid(f"truncate {truncate} is not a known Truncate value")

    def check_options(self, texts: int, id_lists: int, dimensions: int, encoding: int, truncate: int) -> None:
        if texts and id_lists:
            raise invalid("set either texts or token_ids, not both")
        if not texts and not id_lists:
            raise invalid("the request has neither texts nor token_ids")
        self.check_count(texts + id_lists)
        if encoding not in _ENCODINGS:
            raise invalid(f"encoding {encoding} is not a known Encoding value")
        if encoding not in SUPPORTED:
            raise RequestError(grpc.StatusCode.UNIMPLEMENTED,
                               f"encoding {pb.Encoding.Name(encoding)} is not offered yet; "
                               f"offered: {', '.join(pb.Encoding.Name(e) for e in SUPPORTED)}")
        self.check_truncate(truncate)
        if dimensions > self.spec.hidden_size:
            raise invalid(f"dimensions {dimensions} is above the model's {self.spec.hidden_size}")

    async def admit(self, request: pb.EmbedRequest) -> Admitted:
        self.check_options(len(request.texts), len(request.token_ids), request.dimensions,
                           request.encoding, request.truncate)
        if request.texts:
            seqs = await self.tokenize(list(request.texts), request.truncate)
        else:
            seqs = [self.check_ids(i, t.ids, request.truncate) for i, t in enumerate(request.token_ids)]
        return Admitted(seqs, request.dimensions, request.normalize, request.encoding)

    async def admit_tokenize(self, request: pb.TokenizeRequest) -> list[np.ndarray]:
        self.check_count(len(request.texts))
        self.check_truncate(request.truncate)
        return await self.tokenize(list(request.texts), request.truncate)

    async def tokenize(self, texts: list[str], truncate: int) -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.tokenizer.encode, texts, truncate)

    def check_ids(self, i: int, ids, truncate: int) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            raise invalid(f"token_ids[{i}] is empty")
        bad = (arr < 0) | (arr >= self.spec.vocab_size)
        if bad.any():
            raise invalid(f"token_ids[{i}] holds id {int(arr[bad][0])}, outside the vocabulary "
                          f"[0, {self.spec.vocab_size})")
        limit = self.spec.max_tokens
        if arr.size > limit:
            if truncate == pb.TRUNCATE_NONE:
                raise invalid(f"token_ids[{i}] has {arr.size} tokens, over the model's limit of {limit}; "
                              "shorten it or set truncate to TRUNCATE_END or TRUNCATE_START")
            arr = arr[:limit] if truncate == pb.TRUNCATE_END else arr[-limit:]
        return arr.astype(np.int32)
