"""The models a frontend serves, by name: each one's spec, tokenizer, admission, ranker and classifier, and
the choice of the model a request gets.

A request names its model (gRPC `model`, HTTP `model`) or names none and gets the first model,
in --model's order, of the task its method needs (Embed: an embedder; Rerank: a reranker;
Classify: a classifier). A name
that is not served, or a model that does not serve the method's task, is refused
INVALID_ARGUMENT naming the models that can serve it.
"""
from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass

from pollen.common.errors import echo, invalid
from pollen.common.model_spec import ModelSpec
from pollen.server.config import ServeConfig
from pollen.server.pipeline.admission import Admission
from pollen.server.pipeline.outputs import TokenLimits
from pollen.server.pipeline.router import Router
from pollen.server.pipeline.tokenizer import TextTokenizer
from pollen.server.tasks.classify import Classifier
from pollen.server.tasks.rerank import Ranker
from pollen.shared_mem import records
from pollen.shared_mem.ring import Ring

KINDS = {"embed": "an embedding model", "rerank": "a reranker", "classify": "a classifier"}


def token_limits(cfg: ServeConfig, spec: ModelSpec) -> TokenLimits:
    """outputs OUTPUT_TOKENS' bounds: --max-token-vectors a request, and a text's rows within one
    answer record at the model's width (the worker's batcher caps a batch's rows the same way)."""
    per_text = records.max_batch_rows(Ring.max_record_for(cfg.response_ring_bytes), spec.output_dims)
    return TokenLimits(cfg.max_token_vectors, per_text)


@dataclass(slots=True, eq=False)
class ServedModel:
    index: int  # its place in --model's list: the request record's model (common/request.py)
    spec: ModelSpec
    admission: Admission
    ranker: Ranker
    classifier: Classifier
    quantization: str = "none"  # --quantization's value for it: "none" or "fp8" (its products on the GPU)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def task(self) -> str:
        return self.spec.task

    @property
    def dimensions(self) -> int:
        """What Info and /v1/models report: the answer's width (a SPLADE model's: its vocabulary;
        BGE-M3's: its dense vectors')."""
        if self.spec.sparse_terms:
            return self.spec.vocab_size
        return self.spec.hidden_size if self.spec.bge_m3 else self.spec.output_dims

    @property
    def kinds(self) -> tuple[str, ...]:
        """What TEI's routes may ask of a model, its default first: "embed" (dense), "sparse"
        (SPLADE), both (BGE-M3, dense by default), "rerank", "classify"."""
        if self.spec.sparse_terms:
            return ("sparse",)
        return ("embed", "sparse") if self.spec.bge_m3 else (self.spec.task,)


class ModelTable:
    def __init__(self, models: list[ServedModel]):
        self.models = models
        self.by_name = {model.name: model for model in models}
        # A request that names no model gets the first of its task (None: of any), looked up once.
        self.first_of = {None: models[0] if models else None}
        for model in reversed(models):
            self.first_of[model.task] = model

    @classmethod
    def build(cls, cfg: ServeConfig, specs: list[ModelSpec], router: Router, executor: Executor,
              report: bool = True) -> ModelTable:
        """`report`: this frontend logs what its tokenizers' start-up probes find (the first does;
        the others find the same)."""
        models = []
        for index, (path, spec) in enumerate(zip(cfg.model_paths(), specs)):
            tokenizer = TextTokenizer(path, spec.max_tokens, tiktoken=cfg.tiktoken, tokie=cfg.tokie, report=report)
            admission = Admission(spec, tokenizer, executor, cfg.max_texts_per_request,
                                  default_truncate=cfg.default_truncate, model=index,
                                  token_limits=token_limits(cfg, spec))
            ranker = Ranker(spec, admission, router, cfg.max_documents_per_request, cfg.tokenizer_threads)
            models.append(ServedModel(index, spec, admission, ranker, Classifier(spec, admission, router),
                                      cfg.quantizations()[index]))
        return cls(models)

    @property
    def first(self) -> ServedModel:
        return self.models[0]

    def served(self) -> str:
        return ", ".join(f"{model.name} ({model.task})" for model in self.models)

    def pick(self, name: str, task: str | None, method: str) -> ServedModel:
        """The model `name` names (empty: the first of `task`; None: any task), checked to serve
        `task`; else INVALID_ARGUMENT naming the models that can."""
        if name:
            model = self.by_name.get(name)
            if model is None:
                raise invalid(f"model {echo(name)} is not served here; the models served: {self.served()}")
        else:
            model = self.first_of.get(task)
        if model is None or (task is not None and model.task != task):
            able = [m.name for m in self.models if m.task == task]
            what = f"model {model.name} is {KINDS[model.task]}: " if model is not None else ""
            where = f"the models that can: {', '.join(able)}" if able else f"none is served here; the models served: " \
                                                                            f"{self.served()}"
            raise invalid(f"{what}{method} needs {KINDS[task]}, and {where}")
        return model
