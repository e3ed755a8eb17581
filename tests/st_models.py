"""Tiny random sentence-transformers checkpoints, saved by sentence-transformers itself, and the
helpers that compare pollen's engine with them: `SentenceTransformer(dir).encode` is the reference.

A checkpoint is an HF model saved with `save_pretrained` plus a tokenizer, wrapped in
sentence-transformers' own modules (Transformer, Pooling, Dense, Normalize) and saved with
`SentenceTransformer.save`, so modules.json, the module folders and their configs are exactly
what sentence-transformers writes.
"""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch

from pollen.common.model_spec import default_model_path
from pollen.worker.eager_engine import EagerEngine
from pollen.worker.packed import pack

BERT_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
BERT_VOCAB = 30522  # all-MiniLM-L6-v2's tokenizer, which the tiny encoders use

_WORDS = ("search", "embedding", "server", "query", "the", "of", "and", "GPU", "token", "vector", "it's",
          "we'll", "1999", "3.5", "e-mail", "C++", "(note)", "don't", "ranked", "results", "pollen", "bees")


def texts(lengths: list[int], seed: int = 5) -> list[str]:
    """Plain texts of about `lengths` words each."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(n)) for n in lengths]


def copy_bert_tokenizer(path) -> None:
    """all-MiniLM-L6-v2's tokenizer files into `path` (its ids fit BERT_VOCAB): the bundled
    model's, or (on a GPU host without that package) the copy POLLEN_BERT_TOKENIZER_DIR names."""
    folder = os.environ.get("POLLEN_BERT_TOKENIZER_DIR") or default_model_path()
    for name in BERT_TOKENIZER_FILES:
        source = os.path.join(folder, name)
        if os.path.exists(source):
            shutil.copy(source, os.path.join(path, name))


def save_bpe_tokenizer(path, template: str = "<s> $A </s>", vocab_size: int = 400, bos: str = "<s>",
                       eos: str = "</s>") -> int:
    """A byte-level BPE trained on texts() words, its post-processor adding `template`'s special
    tokens (e5-mistral's "<s> $A </s>"; Qwen's "$A <|endoftext|>"; Gemma's "<bos> $A <eos>" with
    bos and eos named so), saved as transformers saves a fast tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [bos, eos, "<pad>", "<|endoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts([12] * 2000, seed=1), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    used = [s for s in specials if s in template.split()]
    tok.post_processor = processors.TemplateProcessing(single=template,
                                                       special_tokens=[(s, tok.token_to_id(s)) for s in used])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token="<pad>")
    fast.save_pretrained(str(path))
    return tok.get_vocab_size()


def randomize(model: torch.nn.Module) -> None:
    """Norm weights and biases away from HF's init (ones and zeros), which would hide a swapped or
    missing norm or bias."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("LayerNorm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))


def save_st(path, hf_dir, pooling: str, dense: list | tuple = (), normalize: bool = False,
            prompts: dict | None = None, default_prompt_name: str | None = None):
    """Wrap the HF model and tokenizer in `hf_dir` in sentence-transformers modules (pooling
    "mean", "cls" or "lasttoken"; `dense`: sentence_transformers Dense modules; a Normalize last
    when asked), save it to `path`, and return the reference loaded back from `path`."""
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(str(hf_dir))
    width = transformer.get_embedding_dimension()
    modules = [transformer, models.Pooling(width, pooling), *dense] + ([models.Normalize()] if normalize else [])
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts,
                        default_prompt_name=default_prompt_name).save(str(path))
    return SentenceTransformer(str(path), device="cpu")


def token_ids(path, texts_: list[str], prompt: str = "") -> list[np.ndarray]:
    """What the frontend feeds the worker: tokenizer.json's ids of prompt + text, special tokens
    added, neither padded nor cut."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(str(path), "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return [np.array(tok.encode(prompt + text).ids, dtype=np.int32) for text in texts_]


def engine_rows(model, sequences: list[np.ndarray], normalize: bool = False) -> np.ndarray:
    """One packed batch through the CPU engine: its output rows, normalized on the engine if asked."""
    flags = np.full(len(sequences), int(normalize), dtype=np.int32)
    return EagerEngine(model).submit(pack(sequences), normalize=flags).result()


def assert_rows_match(ours: np.ndarray, ref: np.ndarray, lengths: bool) -> None:
    """cosine >= 0.99999 on every row; and equal lengths when `lengths` (unnormalized outputs)."""
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    worst = int(np.argmin(cos))
    assert cos.min() >= 0.99999, f"row {worst}: cosine {cos[worst]}"
    if lengths:
        np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-4)
