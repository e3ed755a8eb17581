"""The CPU's products through oneDNN, each weight reordered once at load into oneDNN's blocked layout.

torch's nn.Linear on the CPU hands each product to MKL's sgemm with the weight as the checkpoint
lays it out, and sgemm repacks that weight on every call. A query has ten-odd rows, so the
repacking is most of the product's work: through all six layers of all-MiniLM-L6-v2 it is half of
the query's time. oneDNN's linear takes a weight reordered ahead of time
(torch.ops.mkldnn._reorder_linear_weight, what torch's own CPU compiler uses for frozen weights),
and can apply the GELU that follows in the same pass. The weight is the same float32 numbers; only
their order in memory changes, and with it the summation order of each dot product (differences of
a few ulps, as between two BLAS builds).

`prepack_linears` swaps every nn.Linear of a CPU model for a PackedLinear that holds only the
reordered weight (so the model's memory does not grow), where this torch has oneDNN and the dtype
is one oneDNN takes; EngineOptions.cpu_prepack turns it off to measure it. Nothing may read a
PackedLinear's `weight`: it has none.
"""
from __future__ import annotations

import torch
from torch import nn

# A hint of the rows each product will see; oneDNN's layout for it serves every row count (checked
# for 1..3,000 rows: the same speed as a hint of the exact count, or better).
_ROWS_HINT = 64


def available(dtype: torch.dtype) -> bool:
    return (dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """y = x @ W.T + b (then `activation`, "gelu" exact or "gelu_tanh") on oneDNN's reordered weight."""

    def __init__(self, linear: nn.Linear, activation: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.attr, self.algorithm = {None: ("none", ""), "gelu": ("gelu", "none"),
                                     "gelu_tanh": ("gelu", "tanh")}[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias,
                                                 self.attr, [], self.algorithm)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activation={self.attr}"


def pack(linear: nn.Linear, activation: str | None = None) -> nn.Module:
    """`linear` as a PackedLinear where this torch and its dtype allow; else `linear` itself."""
    return PackedLinear(linear, activation) if available(linear.weight.dtype) else linear


def prepack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear under `model` for a PackedLinear (a module that fuses its activation,
    such as BertLayer, asks through its own `prepack` first); how many were swapped."""
    swapped = 0
    for module in list(model.modules()):
        own = getattr(module, "prepack", None)
        if callable(own) and not isinstance(module, PackedLinear):
            swapped += own()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = pack(child)
                if packed is not child:
                    setattr(parent, name, packed)
                    swapped += 1
    return swapped
