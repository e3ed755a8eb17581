"""MPNet's relative-position attention over packed sequences: softmax(q k^T / sqrt(D) + bias) v,
where bias[h, i, j] depends only on the head and on j - i, the key's position minus the query's,
inside one sequence.

HF's MPNet (MPNetEncoder.compute_position_bias, relative_position_bucket) maps j - i to one of 32
buckets: the sign takes half of them, distances under 8 a bucket each, longer ones log-spaced up
to 128, beyond which everything shares the last bucket; then looks the bucket up in one
[buckets, heads] embedding shared by every layer. Because distances past MAX_DISTANCE all land in
one bucket, the bias is a [heads, 2 * MAX_DISTANCE + 1] table indexed by j - i clamped to
±MAX_DISTANCE: `bias_table` builds it once at load, on the CPU, with HF's very float32 arithmetic
(a bucket boundary computed on another device could round the other way).

`RelativeAttention` runs it: on CUDA in half precision, the Triton kernel of
worker/kernels/relative_attention.py (packed sequences, no host sync, captured into CUDA graphs);
elsewhere one SDPA call per sequence with the bias as its additive float mask, exact and simple,
but it reads cu_seqlens on the host, so a CUDA model on that path runs without graphs
(`host_syncs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pollen.common.model_spec import MPNET_BUCKETS
from pollen.worker.models.ops import Ops

MAX_DISTANCE = 128  # HF's max_distance: from here on every distance has the last bucket of its sign


def relative_buckets(relative: torch.Tensor, buckets: int = MPNET_BUCKETS, max_distance: int = MAX_DISTANCE):
    """HF MPNet's bucket of each relative position (key minus query), int64, in float32 on the
    tensor's device as HF computes it: keys after the query take the upper half of the buckets."""
    half = buckets // 2
    exact = half // 2
    distance = relative.abs()
    # log(0) for distance 0 is -inf; torch.where below never picks it.
    spread = (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)).to(torch.long)
    far = torch.clamp(exact + spread, max=half - 1)
    return (relative > 0).to(torch.long) * half + torch.where(distance < exact, distance, far)


def bias_table(weight: torch.Tensor) -> torch.Tensor:
    """The relative_attention_bias embedding [buckets, heads] -> float32 [heads, 2 * MAX_DISTANCE + 1]:
    column MAX_DISTANCE + r holds every head's bias for a key r positions after its query."""
    relative = torch.arange(-MAX_DISTANCE, MAX_DISTANCE + 1)
    rows = relative_buckets(relative).to(weight.device)
    return weight.float()[rows].t().contiguous()


class RelativeAttention:
    """(q, k, v, cu_seqlens, max_seqlen, causal) -> [T, heads, D], with the table `table` (bias_table,
    set after load; one for all layers) added to the scores. Bidirectional only: `causal` is False.

    `kernel`, when set, is the Triton kernel (q, k, v, cu_seqlens, max_seqlen, table); None: the
    SDPA loop, which reads cu_seqlens on the host (`host_syncs`).
    """

    __slots__ = ("kernel", "table")

    def __init__(self, kernel: Callable | None = None):
        self.kernel = kernel
        self.table: torch.Tensor | None = None

    @classmethod
    def of(cls, ops: Ops) -> RelativeAttention:
        """The kernel where ops has it and its varlen attention is a half-precision CUDA kernel (not
        the SDPA loop of the CPU and of float32): the same devices and dtypes the flash kernels take."""
        takes = ops.relative_attention is not None and ops.attention != "sdpa_loop"
        return cls(ops.relative_attention if takes else None)

    @property
    def host_syncs(self) -> bool:
        return self.kernel is None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_seqlen: int, causal: bool) -> torch.Tensor:
        if causal:
            raise AssertionError("MPNet's relative attention is bidirectional. This is a bug.")
        if self.kernel is not None:
            return self.kernel(q, k, v, cu_seqlens, max_seqlen, self.table)
        return sdpa_loop(q, k, v, cu_seqlens, self.table)


def sequence_bias(table: torch.Tensor, length) -> torch.Tensor:
    """The bias of one sequence of `length` tokens, [heads, length, length]: the table's column of
    each key's position minus its query's, clamped to ±MAX_DISTANCE. `length` may be a traced size
    (the ONNX export's padded length)."""
    at = torch.arange(length, device=table.device)
    relative = (at[None, :] - at[:, None]).clamp(-MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE
    return table[:, relative]


def sdpa_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
              table: torch.Tensor) -> torch.Tensor:
    """One SDPA per sequence, the bias as its float mask [heads, L, L] (in q's dtype, as HF adds it)."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        mask = sequence_bias(table, end - start).to(q.dtype)
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1)
    return out
