"""sentence-transformers Dense modules: the projections some checkpoints apply to their pooled rows
(EmbeddingGemma's 2_Dense and 3_Dense, stella's 2_Dense_1024, LaBSE's 2_Dense), in modules.json's
order, before normalization. common/model_spec.py reads and checks them into DenseModules; this
builds and loads them.

Each computes activation(rows @ weight.T + bias), plus the input itself (projected by a bias-free
`residual` product where the widths differ) when the module says use_residual, as
sentence_transformers' Dense does. They run on the pooled float32 rows with float32 weights, as
the heads do (the products are rows x in x out, nothing beside the encoder), with static shapes
and no host sync, so a CUDA graph replays them with the rest of the forward.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pollen.common.model_spec import DenseModule, UnsupportedModel


class Dense(nn.Module):
    def __init__(self, spec: DenseModule):
        super().__init__()
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.activation = getattr(nn, spec.activation)()  # a DENSE_ACTIVATIONS class, built as ST builds it
        self.add_input = spec.residual
        projected = spec.residual and spec.in_features != spec.out_features
        self.residual = nn.Linear(spec.in_features, spec.out_features, bias=False) if projected else None

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(rows))
        if self.add_input:
            out = out + (rows if self.residual is None else self.residual(rows))
        return out


def load_dense(modules: tuple[DenseModule, ...], device: torch.device | str) -> nn.Sequential | None:
    """The modules in order, their weights read from each one's file, float32 on `device`; None for none."""
    if not modules:
        return None
    with torch.device("meta"):
        layers = [Dense(spec) for spec in modules]
    stack = nn.Sequential(*layers).to_empty(device=device)
    with torch.no_grad():
        for layer, spec in zip(layers, modules):
            stored = _read(spec)
            for name, param in layer.named_parameters():
                where = f"{os.path.basename(spec.path)}/{os.path.basename(spec.weights)}"
                if name not in stored:
                    raise UnsupportedModel(f"{os.path.dirname(spec.path)}: {where} lacks tensor {name}")
                if stored[name].shape != param.shape:
                    raise UnsupportedModel(f"{os.path.dirname(spec.path)}: {where} tensor {name} has shape "
                                           f"{tuple(stored[name].shape)}, its config.json implies {tuple(param.shape)}")
                param.copy_(stored[name])  # converts to float32 and moves to the device
    return stack.eval().requires_grad_(False)


def _read(spec: DenseModule) -> dict[str, torch.Tensor]:
    if spec.weights.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(spec.weights)
    # Older releases saved a pickled state dict; weights_only reads tensors and nothing executable.
    try:
        stored = torch.load(spec.weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds for a bad or unsafe file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # the reason, in the one line
        raise UnsupportedModel(f"{spec.weights}: not a state dict torch reads with weights_only: {first}") from None
    if not isinstance(stored, dict) or not all(isinstance(t, torch.Tensor) for t in stored.values()):
        raise UnsupportedModel(f"{spec.weights}: not a state dict of tensors")
    return stored
