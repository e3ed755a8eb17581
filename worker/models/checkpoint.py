"""Names of checkpoint tensors that a model's hf_weight_map gives beside its plain ones.

A plain name (a str) is looked up under the base model's prefix ("bert.", "model.": see
EmbeddingModel.hf_prefixes). A head sits beside the base model in the checkpoint
("classifier.weight", "score.weight", "lm_head.weight"), so its names are HeadTensors: from the
checkpoint's root unless `under_prefix` (BERT's pooler, tied embeddings), and optionally only one
row, which the loader reads alone (a reranker's two LM-head rows out of the vocabulary's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class HeadTensor:
    name: str
    under_prefix: bool = False
    index: int | None = None  # one row of the tensor, kept as a [1, ...] slice; None: all of it

    def suffixed(self, part: str) -> HeadTensor:
        """The tensor `part` ("weight", "bias") of the layer this names."""
        return replace(self, name=f"{self.name}.{part}")

    def row(self, index: int) -> HeadTensor:
        return replace(self, index=index)

    def full_name(self, prefix: str) -> str:
        return prefix + self.name if self.under_prefix else self.name


def full_name(name: str | HeadTensor, prefix: str) -> str:
    """The name under which `name` is stored in a checkpoint whose base model has `prefix`."""
    return name.full_name(prefix) if isinstance(name, HeadTensor) else prefix + name
