"""The interface every engine model implements (BERT, MPNet, Qwen3), on the CPU and on CUDA."""

from __future__ import annotations

import torch

from pollen.common.engine_options import EngineOptions
from pollen.common.model_spec import ModelSpec
from pollen.worker.models.ops import Ops
from pollen.worker.models.packing import positions as packed_positions
from pollen.worker.models.pooling import normalize_rows, pool


class EmbeddingModel(torch.nn.Module):
    """A packed embedding model: many texts in one flat token row, no pad tokens.

    hidden_states(input_ids [T], positions [T], cu_seqlens [B+1] int32 from 0, max_seqlen) returns
    the last layer's hidden states [T, spec.hidden_size] in the model's dtype. Pooling is not the
    model's business: the engine pools over arbitrary token spans (whole texts, or the chunks of
    one document), so the same forward serves every request kind and every CUDA graph bucket.
    max_seqlen is a Python int so that shape checks and kernels need no device-to-host sync.

    A reranker or classifier has an `output_head` (worker/models/heads.py) that `head` applies to
    the pooled rows, and so has BGE-M3 (worker/models/bge_m3.py, set by the loader from its .pt
    files once the encoder's weights are in); an embedder has None, and `head` hands its rows back through its
    sentence-transformers Dense modules (`dense_modules`, worker/models/dense.py: the loader sets
    them from spec.dense after the weights are in), or as they are when it has none.

    A model is built (on the meta device) with the `Ops` the loader chose for its device, dtype
    and EngineOptions, and builds its attention from them: the forward never chooses a kernel.
    """

    spec: ModelSpec
    ops: Ops
    # Checkpoint name prefixes to try: a BertModel saves "embeddings...", a BertForMaskedLM
    # "bert.embeddings...". The loader picks the prefix under which the most names exist.
    hf_prefixes: tuple[str, ...] = ("",)
    output_head: torch.nn.Module | None  # set by each model's __init__ (worker/models/heads.make_head) or the loader
    # fp8 (worker/models/fp8.py): the products whose input the model's own kernels quantize as they
    # make it (its fused fp8 forward); every other product's input takes a pass of its own.
    fp8_fused: tuple[str, ...] = ()
    # Whether the forward reads device values on the host (an SDPA loop over cu_seqlens): such a
    # model cannot be captured into a CUDA graph, so the CUDA engine runs it eagerly.
    host_syncs: bool = False

    def __init__(self):
        super().__init__()
        self.dense_modules: torch.nn.Module | None = None
        self.fp8_choice = None  # with fp8 products, what the loader measured (worker/models/fp8.py, Choice)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int) -> torch.Tensor:
        raise NotImplementedError

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """What the model answers of its last layer's states [..., hidden]: those states (a SPLADE
        model's are each token's vocabulary weights, worker/models/bert.py)."""
        return x

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """Convenience for tests and tools: one output row per sequence (pooled and, for a model
        with a head, through it), float32, not normalized."""
        pos = packed_positions(cu_seqlens, input_ids.shape[0])
        hidden = self.hidden_states(input_ids, pos, cu_seqlens, max_seqlen)
        return self.head(pool(hidden, cu_seqlens, self.spec.pooling))

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled float32 rows [R, hidden] -> float32 [R, spec.output_dims]: the head's logits, or
        an embedder's rows through its Dense modules (as they are without any)."""
        if self.output_head is not None:
            return self.output_head(pooled)
        return pooled if self.dense_modules is None else self.dense_modules(pooled)

    def output_rows(self, pooled: torch.Tensor, normalize: torch.Tensor | None) -> torch.Tensor:
        """What an engine writes for pooled rows: a head's logits (normalizing scores would mean
        nothing, so the flags are not read), or an embedder's rows (after its Dense modules) with
        those whose `normalize` flag [R] is non-zero L2-normalized (None: none)."""
        rows = self.head(pooled)
        if self.output_head is not None or normalize is None:
            return rows
        return normalize_rows(rows, normalize)

    def after_load(self, options: EngineOptions) -> None:
        """Rewrite the loaded weights into the form the forward wants (the loader calls it once)."""
        self.head_after_load()

    def after_quantize(self, min_tokens: int) -> None:
        """fp8 products from `min_tokens` tokens a batch on (worker/models/fp8.py swapped the layers'
        products): a model whose forward quantizes inside its own fused kernels takes note."""

    def head_after_load(self) -> None:
        """The head's own rewrite (float32 weights, a reranker's folded row)."""
        if self.output_head is not None:
            self.output_head.after_load()

    def head_weight_map(self) -> dict[str, list]:
        """hf_weight_map's entries for the head: under "output_head.", names as heads.py gives them."""
        if self.output_head is None:
            return {}
        return {f"output_head.{ours}": names for ours, names in self.output_head.hf_weight_map().items()}

    def hf_weight_map(self) -> dict[str, list[str]]:
        """Our parameter name -> checkpoint tensor names (without prefix).

        Several names are concatenated along dim 0, which is how fused projections (QKV) load.
        Must cover every parameter: the loader builds the module on the meta device, so anything
        not loaded would be uninitialized memory.
        """
        raise NotImplementedError
