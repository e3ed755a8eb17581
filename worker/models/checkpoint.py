"""Names of checkpoint tensors that a model's hf_weight_map gives beside its plain ones.

A plain name (a str) is looked up under the base model's prefix ("bert.", "model.": see
EmbeddingModel.hf_prefixes). A head sits beside the base model in the checkpoint
("classifier.weight", "score.weight", "lm_head.weight"), so its names are HeadTensors: from the
checkpoint's root unless `under_prefix` (BERT's pooler, tied embeddings), and optionally only one
row, which the loader reads alone (a reranker's two LM-head rows out of the vocabulary's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The scale stored beside an fp8 weight, by name suffix (common/stored_quantization.py).
SCALE_SUFFIXES = ("_scale", "_scale_inv")


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


def dequantize(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An fp8 weight [N, K] times its stored scale, in float32: one scale ([] or [1]), one per
    output channel ([N, 1] or [N]), or one per block ([ceil(N / b), ceil(K / c)]: 128 x 128 blocks,
    the size every fp8 block format uses, or blocks that divide the weight evenly)."""
    values, scale = stored.to(torch.float32), scale.to(torch.float32)
    if scale.numel() == 1:
        return values * scale.reshape(())
    if values.dim() == 2 and scale.numel() == values.shape[0]:
        return values * scale.reshape(-1, 1)
    if values.dim() == 2 and scale.dim() == 2:
        (rows, cols), (s0, s1) = values.shape, scale.shape
        b, c = (128, 128) if (-(-rows // 128), -(-cols // 128)) == (s0, s1) else (rows // s0, cols // s1)
        if (-(-rows // b), -(-cols // c)) == (s0, s1):
            return values * scale.repeat_interleave(b, 0)[:rows].repeat_interleave(c, 1)[:, :cols]
    raise ValueError(f"a scale of shape {tuple(scale.shape)} does not fit a weight of shape {tuple(values.shape)}")
