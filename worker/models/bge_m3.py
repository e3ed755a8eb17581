"""BGE-M3's heads on the rows the engine pools: each row h [hidden] of the XLM-R encoder's last
hidden states becomes [h | normalize(colbert_linear(h)) | relu(sparse_linear(h))], 2 x hidden + 1
float32 values (common/model_spec.py, ModelSpec.bge_m3).

A dense request's row is the text's <s> token (pooling "cls"): the frontend keeps its first
`hidden` values. A request for sparse or ColBERT vectors has a row per token (the token row plan,
server/tasks/token_vectors.py), and the frontend makes FlagEmbedding's outputs from them
(server/tasks/bge_m3.py). The ColBERT vectors leave L2-normalized, as the model always answers them
(a negligible cost on the device, where in a frontend it is a pass over every token's vector); h
leaves raw, and the frontend normalizes the dense vector when the request asks.

The heads' weights are FlagEmbedding's state dicts in the folder's root, sparse_linear.pt
(nn.Linear(hidden, 1)) and colbert_linear.pt (nn.Linear(hidden, hidden)), read with torch.load
and weights_only (tensors only, nothing executable) and checked here, when the worker loads the
model: a file torch cannot read that way, or of other shapes, stops the start with one line.
Both products run as one (hidden + 1 outputs), in float32 like the other heads, with static
shapes and no host sync, so a CUDA graph replays the head with the rest of the forward.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from pollen.common.model_spec import BGE_M3_HEAD_FILES, UnsupportedModel


class BgeM3Head(nn.Module):
    """Rows h [R, hidden] float32 -> [R, 2 x hidden + 1]: h, normalize(colbert_linear(h)),
    relu(sparse_linear(h))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.project = nn.Linear(hidden, hidden + 1)  # colbert_linear's rows, then sparse_linear's

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        projected = self.project(pooled)
        colbert = nn.functional.normalize(projected[:, :self.hidden], dim=1, eps=1e-12)
        return torch.cat([pooled, colbert, projected[:, self.hidden:].relu()], dim=1)

    def hf_weight_map(self) -> dict:
        return {}  # not in the safetensors files: load_head reads them

    def after_load(self) -> None:
        pass


def load_head(path: str, hidden: int, device: torch.device | str) -> BgeM3Head:
    """The heads of the BGE-M3 folder `path`, float32 on `device`; UnsupportedModel naming the file
    and the reason for one torch does not read with weights_only or whose tensors are not
    nn.Linear's of the encoder's width."""
    sparse, colbert = (_linear(os.path.join(path, name), hidden, out) for name, out in
                       zip(BGE_M3_HEAD_FILES, (1, hidden)))
    head = BgeM3Head(hidden)
    with torch.no_grad():
        head.project.weight.copy_(torch.cat([colbert["weight"], sparse["weight"]]))
        head.project.bias.copy_(torch.cat([colbert["bias"], sparse["bias"]]))
    return head.to(device=device, dtype=torch.float32).eval().requires_grad_(False)


def _linear(file: str, hidden: int, outputs: int) -> dict[str, torch.Tensor]:
    """The state dict of an nn.Linear(hidden, outputs) saved in `file`, checked."""
    try:
        stored = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds for a bad or unsafe file
        raise UnsupportedModel(f"{file}: not a state dict torch reads with weights_only: {_reason(exc)}") from None
    shapes = {"weight": (outputs, hidden), "bias": (outputs,)}
    if not isinstance(stored, dict) or not all(isinstance(stored.get(name), torch.Tensor) for name in shapes):
        raise UnsupportedModel(f"{file}: not the state dict of an nn.Linear (tensors weight and bias)")
    for name, shape in shapes.items():
        if tuple(stored[name].shape) != shape:
            raise UnsupportedModel(f"{file}: tensor {name} has shape {tuple(stored[name].shape)}; the "
                                   f"nn.Linear({hidden}, {outputs}) this encoder's width calls for has {shape}")
    return {name: stored[name].float() for name in shapes}


# The lines of torch's weights_only refusal that are advice, not the reason (one of them suggests
# weights_only=False, which is what must not be done with a file of unknown origin).
_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _reason(exc: Exception) -> str:
    """The line of torch.load's error that says what is wrong, for the one line the start ends with."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(_ADVICE)]
    return (said or lines or [type(exc).__name__])[0]
