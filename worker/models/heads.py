"""Output heads of rerankers and classifiers: pooled rows [R, hidden] -> float32 [R, spec.output_dims].

A head runs after pooling, on float32 rows (its weights are kept in float32: the products are
R x hidden x labels, nothing beside the encoder), with static shapes and no host sync, so it is
part of what a CUDA graph replays. Scores leave as raw logits; sigmoid or softmax is the
frontend's business.

    BertForSequenceClassification        pooler dense + tanh on [CLS], then classifier
    (XLM)RobertaForSequenceClassification classifier.dense + tanh on <s>, then classifier.out_proj
    Qwen3ForSequenceClassification       score (no bias) on the last token after the final norm
    Qwen3-Reranker (Qwen3ForCausalLM)    lm_head[yes] - lm_head[no], folded at load into one row
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pollen.common.model_spec import ModelSpec
from pollen.worker.models.checkpoint import HeadTensor


class DenseTanhHead(nn.Module):
    """tanh(dense(x)) then a linear layer: BERT's pooler + classifier, RoBERTa's classification head."""

    def __init__(self, hidden: int, outputs: int, dense: HeadTensor, out: HeadTensor):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, outputs)
        self.names = {"dense": dense, "out": out}

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(pooled)))

    def hf_weight_map(self) -> dict[str, list[HeadTensor]]:
        return {f"{ours}.{p}": [name.suffixed(p)] for ours, name in self.names.items() for p in ("weight", "bias")}

    def after_load(self) -> None:
        self.float()


class LinearHead(nn.Module):
    """One product without bias: Qwen3's score layer, or the folded yes/no row of a reranker."""

    def __init__(self, hidden: int, outputs: int, rows: list[HeadTensor]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden))
        self.rows = rows

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return F.linear(pooled, self.weight)

    def hf_weight_map(self) -> dict[str, list[HeadTensor]]:
        return {"weight": self.rows}

    def after_load(self) -> None:
        self.float()


class YesNoHead(LinearHead):
    """logit("yes") - logit("no") of a causal LM's last token: the two LM-head rows are loaded
    alone (never the vocabulary-wide matrix) and folded into one, so the head is one dot product."""

    def __init__(self, hidden: int, yes_no_ids: tuple[int, int], tied: bool):
        # Tied embeddings: the LM head is embed_tokens itself, under the base model's prefix.
        name = HeadTensor("embed_tokens.weight", under_prefix=True) if tied else HeadTensor("lm_head.weight")
        super().__init__(hidden, 2, [name.row(i) for i in yes_no_ids])

    @torch.no_grad()
    def after_load(self) -> None:
        rows = self.weight.float()
        self.weight = nn.Parameter(rows[:1] - rows[1:], requires_grad=False)


class SparseHead(nn.Module):
    """SPLADE's pooled weights [R, vocab] (worker/models/splade.py) -> [R, 2 x terms]: each row's
    `terms` largest weights, then their vocabulary ids as float32 (exact below 2**24). Zero
    weights are the row's unused places; the frontend keeps the positive ones."""

    def __init__(self, terms: int):
        super().__init__()
        self.terms = terms

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        values, ids = pooled.topk(self.terms, dim=1)
        return torch.cat([values, ids.float()], dim=1)

    def hf_weight_map(self) -> dict[str, list[HeadTensor]]:
        return {}

    def after_load(self) -> None:
        pass


def make_head(spec: ModelSpec, config: dict) -> nn.Module | None:
    """The head of the model `spec` describes; None for a dense embedder (and for BGE-M3, whose
    heads the loader reads from their own files: worker/models/bge_m3.py)."""
    if spec.sparse_terms:
        return SparseHead(spec.sparse_terms)
    if spec.task == "embed":
        return None
    hidden, outputs = config["hidden_size"], spec.output_dims
    if spec.reranker_template:
        return YesNoHead(hidden, spec.yes_no_ids, bool(config.get("tie_word_embeddings", False)))
    architectures = config.get("architectures") or []
    if "Qwen3ForSequenceClassification" in architectures:
        return LinearHead(hidden, outputs, [HeadTensor("score.weight")])
    if "BertForSequenceClassification" in architectures:
        return DenseTanhHead(hidden, outputs, HeadTensor("pooler.dense", under_prefix=True), HeadTensor("classifier"))
    return DenseTanhHead(hidden, outputs, HeadTensor("classifier.dense"), HeadTensor("classifier.out_proj"))
