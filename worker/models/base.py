"""The interface every engine model implements (BERT now; Qwen3 and a CUDA path later)."""

from __future__ import annotations

import torch

from worker.models.spec import ModelSpec


class EmbeddingModel(torch.nn.Module):
    """A packed embedding model: many texts in one flat token row, no pad tokens.

    forward(input_ids [T] int64/int32, cu_seqlens [B+1] int32 starting at 0, max_seqlen) returns
    pooled float32 [B, spec.hidden_size], NOT normalized (normalizing is the caller's choice).
    max_seqlen is a Python int so that shape checks and kernels need no device-to-host sync.
    """

    spec: ModelSpec
    # Checkpoint name prefixes to try: a BertModel saves "embeddings...", a BertForMaskedLM
    # "bert.embeddings...". The loader picks the prefix under which the most names exist.
    hf_prefixes: tuple[str, ...] = ("",)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        raise NotImplementedError

    def hf_weight_map(self) -> dict[str, list[str]]:
        """Our parameter name -> checkpoint tensor names (without prefix).

        Several names are concatenated along dim 0, which is how fused projections (QKV) load.
        Must cover every parameter: the loader builds the module on the meta device, so anything
        not loaded would be uninitialized memory.
        """
        raise NotImplementedError
