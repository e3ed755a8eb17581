"""SPLADE on a BERT or DistilBERT masked-LM checkpoint: each token's vocabulary weights
log(1 + relu(MLM logits)), which the engine then max-pools over each row's tokens (pooling "max",
worker/models/pooling.py) and the SparseHead cuts to each row's largest weights (heads.py).

The MLM head is the checkpoint's own: a dense layer, the activation, a LayerNorm, then the
decoder, tied to the word embeddings (unless config.json unties them), with its own bias:

    BertForMaskedLM        cls.predictions.transform.{dense,LayerNorm}, cls.predictions.bias,
                           cls.predictions.decoder.weight when untied
    DistilBertForMaskedLM  vocab_transform, vocab_layer_norm, vocab_projector.bias,
                           vocab_projector.weight when untied

The vocabulary-wide product is the model's cost: [tokens, vocab] float32 for a batch, which
--max-batch-tokens bounds (a batch of 8,192 tokens on a 30,522-word vocabulary: 1 GB).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pollen.worker.models.checkpoint import HeadTensor

_NAMES = {
    "bert": {"dense": "cls.predictions.transform.dense", "norm": "cls.predictions.transform.LayerNorm",
             "bias": "cls.predictions.bias", "decoder": "cls.predictions.decoder.weight"},
    "distilbert": {"dense": "vocab_transform", "norm": "vocab_layer_norm", "bias": "vocab_projector.bias",
                   "decoder": "vocab_projector.weight"},
}


class SpladeWeights(nn.Module):
    """Hidden states [T, hidden] -> each token's SPLADE weights [T, vocab], float32."""

    def __init__(self, config: dict, layout: str):
        super().__init__()
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        self.layout = layout
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))
        self.bias = nn.Parameter(torch.empty(vocab))
        # HF "gelu" is the exact erf form; "gelu_new"/"gelu_pytorch_tanh" the tanh approximation.
        self.gelu = "none" if config.get("hidden_act", "gelu") == "gelu" else "tanh"
        tied = config.get("tie_word_embeddings", True) is not False
        self.decoder = None if tied else nn.Parameter(torch.empty(vocab, hidden))

    def forward(self, x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """`words`: the word embedding table, the decoder's weight when tied."""
        h = self.norm(F.gelu(self.dense(x), approximate=self.gelu))
        logits = F.linear(h, words if self.decoder is None else self.decoder, self.bias).float()
        return logits.relu_().log1p_()  # in place: the [tokens, vocab] block is the batch's largest

    def hf_weight_map(self) -> dict[str, list[HeadTensor]]:
        names = _NAMES[self.layout]
        m = {f"{ours}.{p}": [HeadTensor(f"{names[ours]}.{p}")]
             for ours in ("dense", "norm") for p in ("weight", "bias")}
        m["bias"] = [HeadTensor(names["bias"])]
        if self.decoder is not None:
            m["decoder"] = [HeadTensor(names["decoder"])]
        return m
