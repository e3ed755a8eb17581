"""Reranking in the frontend: a query and its documents as pairs in the model's own pair form,
admitted as token-id sequences on the path embeddings take (lanes, deadlines, token-budget
batches, the rings), and the model head's outputs turned into sorted scores.

The pair forms:
- a cross-encoder's tokenizer's own template (BERT `[CLS] q [SEP] d [SEP]`, RoBERTa and XLM-R
  `<s> q </s></s> d </s>`), read by post-processing a pair of one-letter texts. Where the model
  has token types (BERT), a token of type 1 travels as its id plus `spec.type_offset`: the
  worker's embedding table holds word + type rows for both types (worker/models/bert.py).
- Qwen3-Reranker's prompt, as its model card builds it: the system text, `<Instruct>`,
  `<Query>` and `<Document>` lines, and the empty think block after.

The query is tokenized once per request and never cut; each document gets the room the query
and the special tokens leave under the limit, and is tokenized only about that far
(server/pipeline/tokenizer.py first_ids).
"""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import numpy as np

from pollen.common.errors import RequestError, invalid
from pollen.common.model_spec import ModelSpec
from pollen.common.request import RequestOptions, Task, lane_of
from pollen.server.pipeline.admission import Admission
from pollen.server.pipeline.request import Request
from pollen.server.pipeline.router import Router
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.v1 import embedder_pb2 as pb

QWEN3_DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION_MAX_CHARS = 4096
# A request's documents are tokenized in groups of at least this many characters each.
GROUP_MIN_CHARS = 8 << 10


@dataclass(frozen=True, slots=True)
class PairForm:
    """Token ids around and between the two texts, with the second text's id offset."""

    before: np.ndarray
    between: np.ndarray
    after: np.ndarray
    second_offset: int

    @classmethod
    def of(cls, tokenizer, type_offset: int) -> PairForm:
        a, b = (tokenizer.encode(t, add_special_tokens=False) for t in ("a", "b"))
        if len(a.ids) != 1 or len(b.ids) != 1:
            raise ValueError("the tokenizer makes more than one token of 'a' or 'b': its pair form cannot be read")
        enc = tokenizer.post_process(a, b)
        ids = np.asarray(enc.ids, np.int64) + type_offset * np.asarray(enc.type_ids, np.int64)
        first, second = (i for i, special in enumerate(enc.special_tokens_mask) if not special)
        return cls(ids[:first].astype(np.int32), ids[first + 1:second].astype(np.int32),
                   ids[second + 1:].astype(np.int32), type_offset * enc.type_ids[second])

    @property
    def special(self) -> int:
        return len(self.before) + len(self.between) + len(self.after)


class PairBuilder:
    def __init__(self, spec: ModelSpec, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.qwen3 = spec.reranker_template
        if self.qwen3:
            raw = tokenizer.tokenizer
            self.prefix = np.asarray(raw.encode(QWEN3_PREFIX, add_special_tokens=False).ids, np.int32)
            self.suffix = np.asarray(raw.encode(QWEN3_SUFFIX, add_special_tokens=False).ids, np.int32)
        else:
            self.form = PairForm.of(tokenizer.tokenizer, spec.type_offset)

    def pairs(self, query: str, documents: list[str], instruction: str, limit: int, truncate: int,
              max_document_tokens: int = 0) -> list[np.ndarray]:
        """One token-id sequence per document, each at most `limit` tokens, its document at most
        `max_document_tokens` (0: no more than the limit)."""
        frame = self.frame(query, instruction, limit, truncate, max_document_tokens)
        return frame.pairs(self.tokenizer, documents)

    def frame(self, query: str, instruction: str, limit: int, truncate: int,
              max_document_tokens: int = 0) -> PairFrame:
        """What every pair of the request shares: the query's part, tokenized once, and the room
        left for a document."""
        if not query:
            raise invalid("query is empty: give the text to rank the documents against")
        if truncate == pb.TRUNCATE_START:
            raise invalid("truncate TRUNCATE_START does not apply to Rerank: a pair over the limit has its "
                          "document's end cut (TRUNCATE_END), or is refused (TRUNCATE_NONE)")
        if self.qwen3:
            if len(instruction) > INSTRUCTION_MAX_CHARS:
                raise invalid(f"instruction has {len(instruction)} characters, over {INSTRUCTION_MAX_CHARS}")
            head_text = (f"<Instruct>: {instruction or QWEN3_DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
                         "<Document>:")  # the document's text follows after a space, tokenized apart
            head = np.concatenate([self.prefix, self.tokenizer.first_ids([head_text], limit + 1, "query")[0]])
            before, between, after, offset = head, np.zeros(0, np.int32), self.suffix, 0
            special = len(self.suffix)
        else:
            if instruction:
                raise invalid("instruction applies to Qwen3-Reranker models, not to this cross-encoder")
            q = self.tokenizer.first_ids([query], limit + 1, "query")[0]
            f = self.form
            before, between, after, offset = np.concatenate([f.before, q]), f.between, f.after, f.second_offset
            special = f.special - len(f.before)
        room = limit - len(before) - special
        if room < 1:
            raise invalid(f"query leaves no room for a document: with the pair's other tokens it takes "
                          f"{len(before) + special if len(before) <= limit else f'more than {limit}'} of the "
                          f"{limit} tokens a pair may have; shorten the query or raise max_tokens")
        if max_document_tokens and max_document_tokens < room:
            room, truncate = max_document_tokens, pb.TRUNCATE_END
        return PairFrame(before, between, after, offset, room, limit, truncate, self.qwen3)


@dataclass(frozen=True, slots=True)
class PairFrame:
    before: np.ndarray   # the pair's tokens before the document (the query's part)
    between: np.ndarray
    after: np.ndarray
    offset: int          # added to the document's ids (its token type)
    room: int            # tokens a document may have
    limit: int
    truncate: int
    qwen3: bool          # the document's text follows a space (Qwen3-Reranker's prompt)

    def texts(self, documents: list[str]) -> list[str]:
        """The documents as the tokenizer gets them."""
        return [" " + d if d else d for d in documents] if self.qwen3 else documents

    def pairs(self, tokenizer: TextTokenizer, documents: list[str], index: list[int] | None = None) -> list[np.ndarray]:
        """The pairs of `documents`, the request's documents[index[i]] (index: all of them, in order)."""
        return self.text_pairs(tokenizer, self.texts(documents), index)

    def text_pairs(self, tokenizer: TextTokenizer, texts: list[str], index: list[int] | None = None,
                   covered: bool = False) -> list[np.ndarray]:
        """`pairs` of the documents as `texts` made them. `covered`: tokie's check found none of
        them held back."""
        index = index or list(range(len(texts)))
        try:
            flat, counts = tokenizer.first_ids_flat(texts, self.room + 1, "documents", covered)
        except RequestError as exc:  # name the document by its index in the request
            raise invalid(re.sub(r"documents\[(\d+)\]", lambda m: f"documents[{index[int(m.group(1))]}]",
                                 exc.message)) from None
        over = np.flatnonzero(counts > self.room)
        if len(over) and self.truncate == pb.TRUNCATE_NONE:
            raise invalid(f"documents[{index[over[0]]}] has more than the {self.room} tokens the query leaves it "
                          f"under the limit of {self.limit} a pair; shorten it or set truncate to TRUNCATE_END")
        return self.assemble(flat, counts)

    def tokie_pairs(self, tokenizer: TextTokenizer, documents: list[str]) -> tuple[list[int], list[np.ndarray]]:
        """The indices of the documents tokie may encode (server/pipeline/tokie_ids.py `held`) and their
        pairs, from one tokie call for them all. The tokenizer must have tokie."""
        texts = self.texts(documents)
        held = tokenizer.tokie.held(texts)
        mine = [i for i in range(len(texts)) if i not in held]
        if not mine:
            return [], []
        return mine, self.text_pairs(tokenizer, [texts[i] for i in mine], mine, covered=True)

    def assemble(self, flat: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
        """Each document's pair, its ids the next `counts[i]` of `flat` cut to the room: put together
        in one array (a concatenation a pair costs several times that), the frame's ids written
        where they go and the documents' kept ids into the places left, and handed out as views."""
        head = np.concatenate([self.before, self.between]).astype(np.int32)
        tail = self.after.astype(np.int32)
        keep = np.minimum(counts, self.room)
        sizes = len(head) + keep + len(tail)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        out = np.empty(int(ends[-1]) if len(ends) else 0, np.int32)
        framed = np.concatenate([(starts[:, None] + np.arange(len(head))).ravel(),
                                 (ends[:, None] - len(tail) + np.arange(len(tail))).ravel()])
        out[framed] = np.concatenate([np.tile(head, len(counts)), np.tile(tail, len(counts))])
        document = np.ones(len(out), bool)
        document[framed] = False
        if (keep < counts).any():  # each document's first `keep` ids
            within = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
            flat = flat[within < np.repeat(keep, counts)]
        out[document] = flat + self.offset if self.offset else flat
        return [out[a:b] for a, b in zip(starts.tolist(), ends.tolist())]


async def head_rows(router: Router, admission: Admission, seqs: list[np.ndarray], priority: int,
                    deadline_ns: int, span=None, tokenize_us: int = 0) -> tuple[np.ndarray, Request, pb.Timing]:
    """`seqs` down the embeddings' path as one Task.SCORE request: the head's float32 rows (one per
    sequence), the request as admitted (its tokens are the usage) and the answer's timing, with
    `tokenize_us`, the caller's time making `seqs`."""
    options = RequestOptions(Task.SCORE, 0, False, pb.ENCODING_FLOAT32, lane_of(priority), deadline_ns, admission.model)
    admitted = Request(seqs, options, None, sum(map(len, seqs)))
    if span is not None:  # the request's server/observe/otel.py span, when tracing
        span.admitted()
    result = await router.answer(admitted)
    rows = np.frombuffer(result.body, np.float32).reshape(result.rows, result.dims)
    return rows, admitted, pb.Timing(queue_us=result.queue_us, inference_us=result.inference_us,
                                     tokenize_us=tokenize_us)


def scores(rows: np.ndarray, raw: bool) -> np.ndarray:
    """The relevance score of each pair from its head's output (one logit): the sigmoid, as
    sentence-transformers' CrossEncoder applies it, or the logit itself with `raw`."""
    logits = rows[:, 0].astype(np.float64)
    return logits if raw else 1.0 / (1.0 + np.exp(-logits))


def rank(request: pb.RerankRequest, values: np.ndarray, response: pb.RerankResponse) -> pb.RerankResponse:
    """`response` given the results, best first (ties in input order), cut to top_n. Added in
    place, from Python numbers: a RerankResult made apart and copied in costs more."""
    order = np.argsort(-values, kind="stable")
    if request.HasField("top_n"):
        order = order[:request.top_n]
    documents = request.documents if request.return_documents else None
    add = response.results.add
    for i, score in zip(order.tolist(), values[order].tolist()):
        add(index=i, score=score, document=documents[i] if documents is not None else "")
    return response


class Ranker:
    """Rerank requests from either door: checked, made pairs, routed, scored."""

    def __init__(self, spec: ModelSpec, admission: Admission, router: Router, max_documents: int,
                 threads: int = 1):
        self.spec, self.admission, self.router = spec, admission, router
        self.threads = threads
        self.max_documents = max_documents
        self.task = spec.task
        self.builder = PairBuilder(spec, admission.tokenizer) if self.task == "rerank" else None

    async def document_pairs(self, frame: PairFrame, documents: list[str]) -> list[np.ndarray]:
        """The documents' pairs: first those tokie encodes (`PairFrame.tokie_pairs`: the check and
        one tokie call for them all, on one tokenizer thread; tokie spreads the call over threads
        of its own, more groups would only contend for the GIL, and the check's work stays off the
        event loop), then the others, for the tokenizers library, in up to --tokenizer-threads
        groups at once (it releases the GIL while it encodes)."""
        out: list[np.ndarray] = [None] * len(documents)  # type: ignore[list-item]
        tokenizer = self.admission.tokenizer
        if tokenizer.tokie is not None:
            mine, part = await self.admission.run(sum(map(len, documents)), frame.tokie_pairs, tokenizer, documents)
            for i, seq in zip(mine, part):
                out[i] = seq
        rest = [i for i, seq in enumerate(out) if seq is None]
        count = max(1, min(self.threads, sum(len(documents[i]) for i in rest) // GROUP_MIN_CHARS))
        size = max(1, -(-len(rest) // count))
        groups = [rest[i:i + size] for i in range(0, len(rest), size)]
        parts = await asyncio.gather(*(
            self.admission.run(sum(len(documents[i]) for i in g), frame.pairs, tokenizer, [documents[i] for i in g], g)
            for g in groups))
        for g, part in zip(groups, parts):
            for i, seq in zip(g, part):
                out[i] = seq
        return out

    async def rerank(self, request: pb.RerankRequest, deadline_ns: int = 0, span=None) -> pb.RerankResponse:
        """The request's documents ranked by this model (server/model_table.py chose it)."""
        n = len(request.documents)
        if not n:
            raise invalid("documents is empty: give at least one document to rank")
        if n > self.max_documents:
            raise invalid(f"documents has {n} entries, over the server's --max-documents-per-request of "
                          f"{self.max_documents}; split the request")
        if request.HasField("top_n") and request.top_n == 0:
            raise invalid("top_n must be at least 1 (leave it unset for every document)")
        deadline_ns = RequestOptions.deadline(deadline_ns, request.timeout_ms)
        limit = self.admission.limit(request.max_tokens)
        truncate = request.truncate if request.HasField("truncate") else pb.TRUNCATE_END
        started_ns = time.monotonic_ns()
        frame = self.builder.frame(request.query, request.instruction, limit, truncate, request.max_document_tokens)
        seqs = await self.document_pairs(frame, list(request.documents))
        rows, admitted, timing = await head_rows(self.router, self.admission, seqs, request.priority, deadline_ns,
                                                 span, (time.monotonic_ns() - started_ns) // 1000)
        return rank(request, scores(rows, request.raw_scores), pb.RerankResponse(
            id=request.id, usage=pb.Usage(prompt_tokens=admitted.tokens), model=self.spec.name, timing=timing))
