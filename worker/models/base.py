"""The interface every engine model implements (BERT, Qwen3), on the CPU and on CUDA."""

from __future__ import annotations

import torch

from pollen.common.engine_options import EngineOptions
from pollen.common.model_spec import ModelSpec
from pollen.worker.models.ops import Ops
from pollen.worker.models.packing import positions as packed_positions
from pollen.worker.models.pooling import pool


class EmbeddingModel(torch.nn.Module):
    """A packed embedding model: many texts in one flat token row, no pad tokens.

    hidden_states(input_ids [T], positions [T], cu_seqlens [B+1] int32 from 0, max_seqlen) returns
    the last layer's hidden states [T, spec.hidden_size] in the model's dtype. Pooling is not the
    model's business: the engine pools over arbitrary token spans (whole texts, or the chunks of
    one document), so the same forward serves every request kind and every CUDA graph bucket.
    max_seqlen is a Python int so that shape checks and kernels need no device-to-host sync.

    A model is built (on the meta device) with the `Ops` the loader chose for its device, dtype
    and EngineOptions, and builds its attention from them: the forward never chooses a kernel.
    """

    spec: ModelSpec
    ops: Ops
    # Checkpoint name prefixes to try: a BertModel saves "embeddings...", a BertForMaskedLM
    # "bert.embeddings...". The loader picks the prefix under which the most names exist.
    hf_prefixes: tuple[str, ...] = ("",)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """Convenience for tests and tools: one pooled float32 vector per sequence, not normalized."""
        pos = packed_positions(cu_seqlens, input_ids.shape[0])
        hidden = self.hidden_states(input_ids, pos, cu_seqlens, max_seqlen)
        return pool(hidden, cu_seqlens, self.spec.pooling)

    def after_load(self, options: EngineOptions) -> None:
        """Rewrite the loaded weights into the form the forward wants (the loader calls it once)."""

    def hf_weight_map(self) -> dict[str, list[str]]:
        """Our parameter name -> checkpoint tensor names (without prefix).

        Several names are concatenated along dim 0, which is how fused projections (QKV) load.
        Must cover every parameter: the loader builds the module on the meta device, so anything
        not loaded would be uninitialized memory.
        """
        raise NotImplementedError
