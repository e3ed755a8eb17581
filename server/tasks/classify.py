"""Classification in the frontend: texts, or text pairs, through a sequence-classification head
with more than one label, answered as each label's score.

A text is tokenized as Embed tokenizes it (the tokenizer's special tokens around it); a pair
(texts[i], text_pairs[i]) is one sequence in the tokenizer's own pair form, as a rerank pair is
(server/tasks/rerank.py PairForm), its second text cut to fit and the first never. The sequences go down
the embeddings' path as one `Task.SCORE` request; the answer's row of logits per sequence becomes
the softmax over the labels, as sentence-transformers' CrossEncoder applies it
(`apply_softmax=True`), or stays the logits with `raw_scores`.
"""
from __future__ import annotations

import time

import numpy as np

from pollen.common.errors import invalid
from pollen.common.model_spec import ModelSpec
from pollen.common.request import RequestOptions, lane_of
from pollen.server.pipeline.admission import Admission
from pollen.server.pipeline.router import Router
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.server.tasks.rerank import PairForm, head_rows
from pollen.v1 import embedder_pb2 as pb


def softmax(logits: np.ndarray) -> np.ndarray:
    """Each row's softmax, in float64."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def labelled(labels: tuple, values: np.ndarray) -> list[pb.ClassifyResult]:
    """One result per row, its labels best first (ties in the labels' order)."""
    results = []
    for i, row in enumerate(values):
        order = np.argsort(-row, kind="stable")
        results.append(pb.ClassifyResult(index=i, labels=[pb.LabelScore(label=labels[j], score=float(row[j]))
                                                          for j in order]))
    return results


def pair_sequences(form: PairForm, tokenizer: TextTokenizer, texts: list[str], pairs: list[str], limit: int,
                   truncate: int) -> list[np.ndarray]:
    """Each (text, pair) as one sequence of at most `limit` tokens; the pair's end is cut to fit
    (TRUNCATE_NONE: refused), the text never."""
    firsts = tokenizer.first_ids(texts, limit + 1, "texts")
    seconds = tokenizer.first_ids(pairs, limit + 1, "text_pairs")
    out = []
    for i, (a, b) in enumerate(zip(firsts, seconds)):
        room = limit - form.special - len(a)
        if room < 1:
            raise invalid(f"texts[{i}] leaves no room for text_pairs[{i}] under the limit of {limit} tokens a "
                          "pair may have; shorten it or raise max_tokens")
        if len(b) > room:
            if truncate == pb.TRUNCATE_NONE:
                raise invalid(f"text_pairs[{i}] has more than the {room} tokens texts[{i}] leaves it under the "
                              f"limit of {limit} a pair; shorten it or set truncate to TRUNCATE_END")
            b = b[:room]
        out.append(np.concatenate([form.before, a, form.between, b + form.second_offset, form.after]).astype(np.int32))
    return out


class Classifier:
    """Classify requests: checked, tokenized, routed, each row's logits made label scores."""

    def __init__(self, spec: ModelSpec, admission: Admission, router: Router):
        self.spec, self.admission, self.router = spec, admission, router
        self.form = PairForm.of(admission.tokenizer.tokenizer, spec.type_offset) if spec.task == "classify" else None

    def check(self, request: pb.ClassifyRequest) -> int:
        """The request's truncate, once its fields are checked."""
        if not request.texts:
            raise invalid("texts is empty: give at least one text to classify")
        self.admission.check_count(len(request.texts))
        if request.text_pairs and len(request.text_pairs) != len(request.texts):
            raise invalid(f"text_pairs has {len(request.text_pairs)} entries for {len(request.texts)} texts; "
                          "give one per text, or none")
        lane_of(request.priority)
        truncate = request.truncate if request.HasField("truncate") else pb.TRUNCATE_END
        if truncate not in (pb.TRUNCATE_NONE, pb.TRUNCATE_END, pb.TRUNCATE_START):
            raise invalid(f"truncate {truncate} is not a known Truncate value")
        if truncate == pb.TRUNCATE_START and request.text_pairs:
            raise invalid("truncate TRUNCATE_START does not apply to text pairs: a pair over the limit has its "
                          "second text's end cut (TRUNCATE_END), or is refused (TRUNCATE_NONE)")
        return truncate

    async def classify(self, request: pb.ClassifyRequest, deadline_ns: int = 0, span=None) -> pb.ClassifyResponse:
        """The request's texts classified by this model (server/model_table.py chose it)."""
        started_ns = time.monotonic_ns()
        truncate = self.check(request)
        deadline_ns = RequestOptions.deadline(deadline_ns, request.timeout_ms)
        limit = self.admission.limit(request.max_tokens)
        tokenizer, texts = self.admission.tokenizer, list(request.texts)
        chars = sum(map(len, texts)) + sum(map(len, request.text_pairs))
        if request.text_pairs:
            seqs = await self.admission.run(chars, pair_sequences, self.form, tokenizer, texts,
                                            list(request.text_pairs), limit, truncate)
        else:
            seqs = await self.admission.run(chars, lambda: tokenizer.encode(texts, truncate, limit,
                                                                            chunk_mean_hint=False))
        rows, admitted, timing = await head_rows(self.router, self.admission, seqs, request.priority, deadline_ns,
                                                 span, (time.monotonic_ns() - started_ns) // 1000)
        logits = rows.astype(np.float64)
        return pb.ClassifyResponse(
            id=request.id, results=labelled(self.spec.labels, logits if request.raw_scores else softmax(logits)),
            usage=pb.Usage(prompt_tokens=admitted.tokens), model=self.spec.name, timing=timing)
