"""LazyTensor: rows whose data is valid only once a CUDA event has fired.

The CUDA engine hands these out (they are its PendingRows, worker/engine.py) so the worker can
launch batch N+1 before it waits on batch N: nothing blocks until someone asks for the data
(`result`), and asking twice costs nothing. For the worker the rows are the batch's records in
the response rings (or, for a bulk batch, a pinned buffer of the engine's), so a fired event
means the pooled rows are there.
"""
from __future__ import annotations

import torch


class LazyTensor:
    __slots__ = ("value", "event")

    def __init__(self, value, event: torch.cuda.Event):
        self.value = value  # a pinned tensor of the engine's, or the caller's numpy `out` (one or a list)
        self.event = event

    def done(self) -> bool:
        """True once the producing work is done (never blocks)."""
        return self.event.query()

    def result(self):
        """Block the calling thread until the data is valid; return it (as numpy)."""
        self.event.synchronize()
        return self.value.numpy() if isinstance(self.value, torch.Tensor) else self.value
