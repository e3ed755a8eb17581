"""Random-weight rerankers in the real Hugging Face formats, made on the GPU machine itself, for
load/bench_rerank.py and tests/test_cuda_rerank.py.

Shapes: a MiniLM-L6 cross-encoder (BertForSequenceClassification, cross-encoder/ms-marco-MiniLM-
L6-v2's), an XLM-R-large one (XLMRobertaForSequenceClassification, BAAI/bge-reranker-v2-m3's) and
Qwen3-Reranker-0.6B (a Qwen3ForCausalLM with tied embeddings, served by its yes/no logits). The
BERT and XLM-R shapes are given the MiniLM tokenizer (BERT's WordPiece: XLM-R's own SentencePiece
tokenizer ships in no package this project installs, so the XLM-R shape's pairs are BERT-formed,
with its one token type), the Qwen3 shape the real Qwen3 tokenizer.json.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

RERANK_SHAPES = {
    "minilm-l6-cross-encoder": dict(kind="bert", hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                    intermediate_size=1536, vocab_size=30522, max_position_embeddings=512),
    "bge-reranker-v2-m3": dict(kind="xlmr", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                               intermediate_size=4096, vocab_size=250002, max_position_embeddings=8194,
                               type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5),
    "qwen3-reranker-0.6b": dict(kind="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151669,
                                max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
}
BERT_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def make_reranker(shape: str, root: str, bert_tokenizer_dir: str, qwen3_tokenizer: str, seed: int = 0) -> str:
    """Write the checkpoint (once) with its tokenizer and return its directory."""
    import transformers as tf

    path = os.path.join(root, shape)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = dict(RERANK_SHAPES[shape])
    kind = cfg.pop("kind")
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        if kind == "qwen3":
            model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**cfg))
        elif kind == "xlmr":
            model = tf.XLMRobertaForSequenceClassification(tf.XLMRobertaConfig(num_labels=1, **cfg))
        else:
            model = tf.BertForSequenceClassification(tf.BertConfig(num_labels=1, **cfg))
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():  # norms away from 1 and a head that spreads the scores
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("LayerNorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.startswith("classifier") and name.endswith("weight"):
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path, max_shard_size="2GB")
    del model
    torch.cuda.empty_cache()
    if kind == "qwen3":
        shutil.copy(qwen3_tokenizer, os.path.join(path, "tokenizer.json"))
    else:
        for name in BERT_TOKENIZER_FILES:
            if os.path.exists(os.path.join(bert_tokenizer_dir, name)):
                shutil.copy(os.path.join(bert_tokenizer_dir, name), os.path.join(path, name))
    if kind == "xlmr":  # one token type: the reference's BERT tokenizer must not send type ids of 1
        config_path = os.path.join(path, "tokenizer_config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["model_input_names"] = ["input_ids", "attention_mask"]
        with open(config_path, "w") as f:
            json.dump(config, f)
    return path


def make_trained_minilm_reranker(minilm_dir: str, root: str, seed: int = 0) -> str:
    """A MiniLM-L6 cross-encoder whose encoder is trained: all-MiniLM-L6-v2's weights (its pooler
    too) under a random one-label head, as BertForSequenceClassification with its tokenizer, written
    once under `root`. It has cross-encoder/ms-marco-MiniLM-L6-v2's shape. Random encoders score
    every pair within a narrow band, where rounding alone reorders neighbours; a trained encoder
    spreads pairs as a real model does, so bf16 against fp32 ranks are measured on real spread."""
    import transformers as tf

    path = os.path.join(root, "minilm-l6-trained-encoder")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = tf.BertForSequenceClassification.from_pretrained(minilm_dir, num_labels=1, torch_dtype=torch.float32)
    with torch.no_grad():
        head = model.classifier
        head.weight.copy_(torch.randn_like(head.weight) / head.weight.shape[-1] ** 0.5)
        head.bias.zero_()
    model.save_pretrained(path)
    for name in BERT_TOKENIZER_FILES:
        if os.path.exists(os.path.join(minilm_dir, name)):
            shutil.copy(os.path.join(minilm_dir, name), os.path.join(path, name))
    return path


def stsb_pairs(path: str, n: int) -> list[tuple[str, str]]:
    """The first n (sentence1, sentence2) rows of the STS-B test CSV."""
    import csv

    with open(path, newline="") as f:
        return [(row[0], row[1]) for row, _ in zip(csv.reader(f), range(n))]
