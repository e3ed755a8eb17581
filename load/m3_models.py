"""A random-weight BAAI/bge-m3 folder in the real shape and format, for a benchmark of its dense,
sparse and ColBERT outputs (pollen serves all three from one forward pass).

bge-m3 is XLM-RoBERTa-large (hidden 1024, 24 layers, 16 heads, intermediate 4096, a vocabulary of
250,002, 8,194 positions) saved with `save_pretrained` in float32 as the hub's weights are, in a
sentence-transformers folder (modules.json: Transformer, Pooling on the CLS token, Normalize;
sentence_bert_config.json's max_seq_length 8192), with FlagEmbedding's two heads in its root:
sparse_linear.pt (the state dict of nn.Linear(1024, 1)) and colbert_linear.pt (nn.Linear(1024,
1024)), written with torch.save. The weights are drawn on the GPU when there is one.

The tokenizer's files are copied from `tokenizer_dir`: XLM-R's own where it can be had (its
tokenizer.json), else any whose ids fit the vocabulary (the MiniLM WordPiece tokenizer this
project ships). `make_bge_m3(..., tiny=True)` gives the same layout with small sizes, for a smoke
run on the CPU. A folder is written once under `root` and reused.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

BGE_M3 = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
              vocab_size=250002, max_position_embeddings=8194, type_vocab_size=1, pad_token_id=1,
              layer_norm_eps=1e-5)
# The layout with small sizes; the vocabulary stays large enough for any tokenizer given.
TINY = dict(BGE_M3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
MAX_SEQ_LENGTH = 8192
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "sentencepiece.bpe.model",
                   "vocab.txt")


def make_bge_m3(root: str, tokenizer_dir: str, tiny: bool = False, seed: int = 0) -> str:
    """Write the folder (once) under `root` and return its path."""
    import transformers as tf

    path = os.path.join(root, "bge-m3-tiny" if tiny else "bge-m3")
    if os.path.exists(os.path.join(path, "colbert_linear.pt")):
        return path
    sizes = TINY if tiny else BGE_M3
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = tf.XLMRobertaModel(tf.XLMRobertaConfig(**sizes), add_pooling_layer=True).eval()
        hidden = sizes["hidden_size"]
        sparse, colbert = torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, hidden)
    with torch.no_grad():  # norms away from 1, as trained ones are
        for name, p in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="5GB")
    for name, linear in (("sparse_linear.pt", sparse), ("colbert_linear.pt", colbert)):
        torch.save({k: v.detach().cpu() for k, v in linear.state_dict().items()}, os.path.join(path, name))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    write_sentence_transformers_files(path, hidden)
    return path


def write_sentence_transformers_files(path: str, hidden: int) -> None:
    """bge-m3's module files: Transformer, Pooling on the CLS token, Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    for name, value in (("modules.json", modules), ("1_Pooling/config.json", pooling),
                        ("sentence_bert_config.json", {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})):
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2)
