"""The bulk lane's share of a GPU's SMs (`--bulk-sms`).

Stream priorities decide only which waiting block an SM takes next: a query's kernels still wait
for the bulk blocks already on the SMs to finish, kernel after kernel. In a CUDA green context
the bulk lane's kernels run on a fixed subset of the SMs, so the rest are free the moment an
interactive batch arrives; the interactive lane keeps every SM (it has them all when no bulk work
runs, and docs sent at the default priority use them all). The default leaves an eighth of the
SMs (at least 8) to queries.
"""
from __future__ import annotations

import torch


def green_contexts_supported() -> bool:
    try:
        from torch.cuda import green_contexts
    except ImportError:
        return False
    return getattr(green_contexts, "SUPPORTED", True)


def bulk_sm_count(requested: int, total: int, supported: bool) -> int:
    """The SMs the bulk lane gets: 0 means all of them (no green context). `requested` -1 is the
    default (all but an eighth of `total`, at least 8 left, where green contexts exist; else all);
    0 is every SM; N is N SMs, which must be fewer than `total`."""
    if requested == 0:
        return 0
    if requested < 0:
        return total - max(8, total // 8) if supported and total > 16 else 0
    if requested >= total:
        raise ValueError(f"--bulk-sms {requested}: this GPU has {total} SMs; ask for fewer, or 0 for all of them")
    if not supported:
        raise RuntimeError(f"--bulk-sms {requested} needs CUDA green contexts (torch.cuda.green_contexts), which "
                           f"this torch {torch.__version__} lacks; use --bulk-sms 0")
    return requested


# Every green context made, kept until the process ends: one destroyed while memory or graphs
# made on its streams live (an engine's lanes, the allocator's cached blocks) aborts the process
# when those are freed ("CUDA error: context is destroyed"). The engines of one process (a worker
# with several models) share one per device and size: their bulk lanes run on the same SMs.
_KEPT: list = []
_SHARED: dict[tuple[int, int], BulkPartition] = {}


class BulkPartition:
    """A green context of `sms` SMs on `device` and the streams made from it."""

    def __init__(self, device: torch.device, sms: int):
        from torch.cuda import green_contexts

        index = device.index if device.index is not None else torch.cuda.current_device()
        self.sms = sms
        self.context = green_contexts.GreenContext.create(num_sms=sms, device_id=index)
        _KEPT.append(self.context)

    @classmethod
    def shared(cls, device: torch.device, sms: int) -> BulkPartition:
        """This process's partition of `sms` SMs on `device`, made at the first call."""
        key = (device.index if device.index is not None else torch.cuda.current_device(), sms)
        if key not in _SHARED:
            _SHARED[key] = cls(device, sms)
        return _SHARED[key]

    def stream(self) -> torch.cuda.Stream:
        return self.context.Stream()
