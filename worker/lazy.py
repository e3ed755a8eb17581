"""LazyTensor: a tensor whose data is valid only once a CUDA event has fired.

The CUDA engine hands these out so the worker can launch batch N+1 before it waits on batch N:
nothing blocks until someone asks for the data (`wait`), and asking twice costs nothing. For the
worker the tensor is the batch's record in the response ring, so a fired event means the pooled
rows are in the ring.
"""
from __future__ import annotations

import torch


class LazyTensor:
    __slots__ = ("tensor", "event")

    def __init__(self, tensor: torch.Tensor, event: torch.cuda.Event):
        self.tensor = tensor
        self.event = event

    def ready(self) -> bool:
        """True once the producing work is done (never blocks)."""
        return self.event.query()

    def wait(self) -> torch.Tensor:
        """Block the calling thread until the data is valid; return it."""
        self.event.synchronize()
        return self.tensor
