"""Random-weight checkpoints in the real Hugging Face format, made on the GPU machine itself.

Shapes: Qwen3-0.6B, Qwen3-4B, Qwen3-8B and BERT-base. Weights are drawn on the GPU (fast
even for 4B), saved with save_pretrained (sharded, as real checkpoints are), and read back through
pollen's own loader by the benchmarks. A word-level tokenizer.json is written next to them so
`pollen serve` can start; the benchmarks send token ids.
"""
from __future__ import annotations

import json
import os

import torch

SHAPES = {
    "qwen3-0.6b": dict(kind="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151669,
                       max_position_embeddings=32768, rope_theta=1000000.0),
    "qwen3-4b": dict(kind="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151669,
                     max_position_embeddings=32768, rope_theta=1000000.0),
    "qwen3-8b": dict(kind="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151669,
                     max_position_embeddings=32768, rope_theta=1000000.0),
    "bert-base": dict(kind="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, vocab_size=30522, max_position_embeddings=512),
    # For trying a benchmark script on a machine without a GPU.
    "qwen3-tiny": dict(kind="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=151669,
                       max_position_embeddings=8192, rope_theta=1000000.0),
}


def make_checkpoint(shape: str, root: str, seed: int = 0) -> str:
    """Write the checkpoint (once) and return its directory."""
    import transformers as tf

    path = os.path.join(root, shape)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = dict(SHAPES[shape])
    kind = cfg.pop("kind")
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        if kind == "qwen3":
            model = tf.Qwen3Model(tf.Qwen3Config(**cfg))
        else:
            model = tf.BertModel(tf.BertConfig(**cfg))
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():  # norms away from 1, so a dropped or swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("LayerNorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="2GB")
    del model
    torch.cuda.empty_cache()
    write_tokenizer(path, cfg["vocab_size"])
    pooling = {"qwen3": "lasttoken", "bert": "mean_tokens"}[kind]
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode": pooling} if kind == "qwen3" else {"pooling_mode_mean_tokens": True}, f)
    return path


def with_tokenizer(path: str, tokenizer_json: str) -> str:
    """The same weights beside another tokenizer.json (the real one of the model family), via symlinks."""
    import shutil

    out = path.rstrip("/") + "-tok"
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(path):
            if name != "tokenizer.json" and not os.path.exists(os.path.join(out, name)):
                os.symlink(os.path.join(path, name), os.path.join(out, name))
        shutil.copy(tokenizer_json, os.path.join(out, "tokenizer.json"))
    return out


def pplx_variant(path: str) -> str:
    """The same weights under model_type bidirectional_pplx_qwen3 (pplx-embed-v1's), via symlinks."""
    out = path.rstrip("/") + "-pplx"
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(path):
        if name.endswith(".safetensors") or name.endswith(".json") and name != "config.json":
            os.symlink(os.path.join(path, name), os.path.join(out, name))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["model_type"] = "bidirectional_pplx_qwen3"
    cfg["architectures"] = ["PPLXQwen3Model"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def write_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
