"""Check an EmbedRequest against the model and the limits; turn it into token-id sequences.

Every refusal names the field and the problem, so a client can fix its request from the message.
The request options resolve here (docs/design/requests.md, "Request options"):
- prompt_name / prompt: prepended to every text before tokenization; the default prompt name
  (--default-prompt-name, else the checkpoint's default_prompt_name) applies when a request
  names neither. Refused with token_ids (those are the complete model input) and the default is
  not applied to them. At most PROMPT_MAX_CHARS characters and fewer tokens than the limit leaves
  for text (docs/design/bounds.md, "Bounds").
- truncate: an unset one (proto3 `optional`: no field presence; over HTTP, no "truncate" key)
  is the server's --default-truncate; one the request sets, TRUNCATE_NONE included, is kept.
- max_tokens: the limit per sequence, at most the model's.
- long_input CHUNK_MEAN: texts over the limit become overlapping windows (server/pipeline/tokenizer.py)
  whose pooled vectors the worker averages, weighted by each window's tokens.
- chunks: one document; one output row per chunk (server/pipeline/tokenizer.py encode_document).
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor

import numpy as np

from pollen.common.errors import echo, invalid
from pollen.common.model_spec import MIN_MATRYOSHKA_DIMS, ModelSpec
from pollen.common.request import LANES, TRUNCATE_BY_NAME, RequestOptions, Task, lane_of
from pollen.server.pipeline import outputs
from pollen.server.pipeline.request import Request
from pollen.server.pipeline.tokenizer import PROMPT_MAX_CHARS, TextTokenizer
from pollen.shared_mem.records import RowPlan
from pollen.v1 import embedder_pb2 as pb

_ENCODINGS = set(pb.Encoding.values())
_TRUNCATES = set(pb.Truncate.values())
_LONG_INPUTS = set(pb.LongInput.values())
# Requests with at most this many characters are tokenized on the event loop itself: a short query
# tokenizes in less time than the hop to the pool and back (two thread wake-ups and a loop
# wake-up). Longer ones go to the pool, so that a big request never stalls the loop.
INLINE_CHARS = 2048


class ModelChecks:
    """The checks of a request's model options that the bulk embedder makes too."""

    def __init__(self, spec: ModelSpec, tokenizer: TextTokenizer):
        self.spec = spec
        self.tokenizer = tokenizer
        self.prompts = dict(spec.prompts)

    def allowed_dimensions(self) -> str:
        if self.spec.matryoshka_dimensions:
            return "one of " + ", ".join(map(str, self.spec.matryoshka_dimensions))
        return f"from {MIN_MATRYOSHKA_DIMS} to {self.spec.hidden_size}"

    def check_dimensions(self, dimensions: int) -> None:
        if dimensions == 0 or dimensions == self.spec.hidden_size:
            return
        sizes = self.spec.matryoshka_dimensions
        ok = dimensions in sizes if sizes else MIN_MATRYOSHKA_DIMS <= dimensions <= self.spec.hidden_size
        if not ok:
            raise invalid(f"dimensions {dimensions} is not offered by this model; allowed: 0 (full size) or "
                          f"{self.allowed_dimensions()}")

    def limit(self, max_tokens: int) -> int:
        if max_tokens > self.spec.max_tokens:
            raise invalid(f"max_tokens {max_tokens} is over the model's limit of {self.spec.max_tokens}")
        if max_tokens and max_tokens <= self.tokenizer.special:
            raise invalid(f"max_tokens {max_tokens} leaves no room for text beside the model's "
                          f"{self.tokenizer.special} special tokens")
        return max_tokens or self.spec.max_tokens

    def prompt(self, prompt_name: str, prompt: str, limit: int) -> str:
        """The prompt to prepend (named, literal or the model's default), checked to be at most
        PROMPT_MAX_CHARS characters and to leave room for text under `limit`: it is tokenized
        with every text (server/pipeline/tokenizer.py), so its size multiplies by the request's texts."""
        if prompt_name and prompt:
            raise invalid("set either prompt_name or prompt, not both")
        field = "prompt"
        if not prompt:
            named = prompt_name or self.spec.default_prompt_name
            if not named:
                return ""
            if named not in self.prompts:
                known = ", ".join(sorted(self.prompts)) if self.prompts else "none (the model defines no prompts)"
                raise invalid(f"prompt_name {echo(named)} is not one of the model's prompts; known: {known}")
            prompt = self.prompts[named]
            field = f"prompt_name {echo(named)}" if prompt_name else f"the default prompt_name {echo(named)}"
        if len(prompt) > PROMPT_MAX_CHARS:
            raise invalid(f"{field} has {len(prompt)} characters, over the limit of {PROMPT_MAX_CHARS} "
                          "(the prompt is tokenized with every text)")
        tokens = self.tokenizer.prompt_tokens(prompt)
        if tokens >= self.tokenizer.room(limit):
            raise invalid(f"{field} has {tokens} tokens, which leave no room for text under "
                          f"{self.tokenizer.limit_name(limit)} ({self.tokenizer.special} of it for special tokens)")
        return prompt


class Admission(ModelChecks):
    def __init__(self, spec: ModelSpec, tokenizer: TextTokenizer, executor: Executor, max_texts: int,
                 default_truncate: str = "none", model: int = 0,
                 token_limits: outputs.TokenLimits = outputs.TokenLimits(0, 0)):
        super().__init__(spec, tokenizer)
        self.model = model  # the model's index among the server's (RequestOptions.model)
        self.token_limits = token_limits  # outputs OUTPUT_TOKENS' bounds (outputs.token_rows)
        self.default_truncate = TRUNCATE_BY_NAME[default_truncate]
        self.executor = executor
        self.max_texts = max_texts

    def check_count(self, inputs: int, limit: int = 0) -> None:
        limit = limit or self.max_texts
        if inputs > limit:
            raise invalid(f"{inputs} inputs in one request, over the limit of {limit}; split the request")

    def truncate(self, request: pb.EmbedRequest | pb.TokenizeRequest) -> int:
        """The request's truncate, or the server's default when the request leaves it unset."""
        if not request.HasField("truncate"):
            return self.default_truncate
        if request.truncate not in _TRUNCATES:
            raise invalid(f"truncate {request.truncate} is not a known Truncate value")
        return request.truncate

    def check_options(self, request: pb.EmbedRequest, max_inputs: int = 0) -> outputs.Outputs:
        """The request's options checked against each other and the model; what it asks the answer to hold."""
        given = [name for name, n in (("texts", len(request.texts)), ("token_ids", len(request.token_ids)),
                                      ("chunks", len(request.chunks))) if n]
        if len(given) > 1:
            raise invalid(f"set exactly one of texts, token_ids and chunks, not both {' and '.join(given)}")
        if not given:
            raise invalid("the request has neither texts nor token_ids nor chunks")
        self.check_count(len(request.texts) + len(request.token_ids) + len(request.chunks), max_inputs)
        if request.encoding not in _ENCODINGS:
            raise invalid(f"encoding {request.encoding} is not a known Encoding value")
        if request.long_input not in _LONG_INPUTS:
            raise invalid(f"long_input {request.long_input} is not a known LongInput value")
        lane_of(request.priority)
        self.check_dimensions(request.dimensions)
        wanted = outputs.wanted(request, self.spec)
        chunk_mean = request.long_input == pb.LONG_INPUT_CHUNK_MEAN
        if request.token_ids:
            if request.prompt_name or request.prompt:
                raise invalid("prompt_name and prompt apply to texts and chunks, not to token_ids "
                              "(token_ids are the complete model input; put the prompt's tokens in them)")
            if chunk_mean:
                raise invalid("long_input LONG_INPUT_CHUNK_MEAN applies to texts, not to token_ids")
        if request.chunks and chunk_mean:
            raise invalid("long_input LONG_INPUT_CHUNK_MEAN applies to texts, not to chunks "
                          "(a contextual-chunk document must fit in one sequence)")
        return wanted

    async def admit(self, request: pb.EmbedRequest, deadline_ns: int = 0, max_inputs: int = 0) -> Request:
        """The request as token-id sequences and resolved options; `deadline_ns` (CLOCK_MONOTONIC,
        0: none) is when it must reach the model; `max_inputs` the inputs it may hold (0: the
        server's max_texts). Past max_texts the router sends it as several records."""
        wanted = self.check_options(request, max_inputs)
        truncate = self.truncate(request)
        limit = self.limit(request.max_tokens)
        rows = None
        if request.token_ids:
            seqs = [self.check_ids(i, t.ids, truncate, limit) for i, t in enumerate(request.token_ids)]
        else:
            prompt = self.prompt(request.prompt_name, request.prompt, limit)
            chars = (len(prompt) * max(1, len(request.texts)) + sum(map(len, request.texts))
                     + sum(map(len, request.chunks)))
            if request.chunks:
                seq, spans = await self.run(chars, self.tokenizer.encode_document, list(request.chunks), limit,
                                            prompt)
                seqs = [seq]
                n = len(spans)
                rows = RowPlan(np.zeros(n, np.uint32), np.array([a for a, _ in spans], np.uint32),
                               np.array([b for _, b in spans], np.uint32), np.arange(n, dtype=np.uint32),
                               np.ones(n, np.float32))
            elif request.long_input == pb.LONG_INPUT_CHUNK_MEAN:
                windows = await self.run(chars, self.tokenizer.encode_windows, list(request.texts), limit, prompt)
                seqs, rows = window_plan(windows)
            else:
                seqs = await self.run(chars, self.tokenizer.encode, list(request.texts), truncate, limit, prompt)
        # BGE-M3's rows carry its heads' outputs after the dense vector: a dense answer is their
        # first hidden_size values, which the worker cuts as it cuts any Matryoshka prefix.
        dims = request.dimensions or (self.spec.hidden_size if self.spec.bge_m3 else 0)
        options = RequestOptions(Task.EMBED, dims, request.normalize, request.encoding,
                                 LANES[request.priority], deadline_ns, self.model)
        if wanted.tokens or wanted.sparse:
            # Raw full-width rows (for tokens and BGE-M3's sparse vectors, a row per token): the
            # frontend makes the answer from them (server/tasks/token_vectors.py, server/tasks/sparse_vectors.py,
            # server/tasks/bge_m3.py).
            if wanted.tokens or self.spec.bge_m3:
                asked = "OUTPUT_TOKENS" if wanted.tokens else "OUTPUT_SPARSE"
                rows = outputs.token_rows(seqs, self.token_limits, asked)
            options = RequestOptions(Task.EMBED, 0, False, pb.ENCODING_FLOAT32, LANES[request.priority],
                                     deadline_ns, self.model)
        return Request(seqs, options, rows, sum(map(len, seqs)), wanted=wanted)

    async def admit_tokenize(self, request: pb.TokenizeRequest) -> list[np.ndarray]:
        self.check_count(len(request.texts))
        truncate = self.truncate(request)
        limit = self.limit(request.max_tokens)
        prompt = self.prompt(request.prompt_name, request.prompt, limit)
        chars = len(prompt) * len(request.texts) + sum(map(len, request.texts))
        return await self.run(chars, functools.partial(self.tokenizer.encode, chunk_mean_hint=False),
                              list(request.texts), truncate, limit, prompt)

    async def run(self, chars: int, fn, *args):
        """fn(*args): inline when the input is small (see INLINE_CHARS), else on the tokenizer pool."""
        if chars <= INLINE_CHARS:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, fn, *args)

    def check_ids(self, i: int, ids, truncate: int, limit: int) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            raise invalid(f"token_ids[{i}] is empty")
        bad = (arr < 0) | (arr >= self.spec.vocab_size)
        if bad.any():
            raise invalid(f"token_ids[{i}] holds id {int(arr[bad][0])}, outside the vocabulary "
                          f"[0, {self.spec.vocab_size})")
        if arr.size > limit:
            if truncate == pb.TRUNCATE_NONE:
                raise invalid(f"token_ids[{i}] has {arr.size} tokens, over {self.tokenizer.limit_name(limit)}; "
                              "shorten it or set truncate to TRUNCATE_END or TRUNCATE_START")
            arr = arr[:limit] if truncate == pb.TRUNCATE_END else arr[-limit:]
        return arr.astype(np.int32)


def window_plan(windows: list[list[np.ndarray]]) -> tuple[list[np.ndarray], RowPlan | None]:
    """CHUNK_MEAN: every window is a sequence pooled whole; a text's windows share its output,
    weighted by their token counts (special tokens included: the tokens each mean pooled over)."""
    seqs = [w for ws in windows for w in ws]
    if len(seqs) == len(windows):
        return seqs, None  # every text fitted: plain rows
    n = len(seqs)
    out = np.repeat(np.arange(len(windows), dtype=np.uint32), [len(ws) for ws in windows])
    lengths = np.array([len(s) for s in seqs], dtype=np.uint32)
    return seqs, RowPlan(np.arange(n, dtype=np.uint32), np.zeros(n, np.uint32), lengths, out,
                         lengths.astype(np.float32))
