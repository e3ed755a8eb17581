"""Random-weight checkpoints of the embedding models people run most, in their real shapes and
formats, as sentence-transformers folders, for load/bench_models.py.

Each shape is the real model's config.json (sizes, attention pattern, windows, RoPE) saved with
transformers' `save_pretrained`, in the real weights' dtype, beside the sentence-transformers
files the real model has, written as its hub folder has them: modules.json, 1_Pooling, the Dense
modules, Normalize, sentence_bert_config.json. The weights are drawn on the device they are built
on (seconds even for 7B). A checkpoint is written once under `root`, in a folder named by its shape
and tokenizer, and reused.

Tokenizers: the real one where it can be had here, else a stand-in whose vocabulary the model's
vocab_size is set to (see `Tokenizer`). `tiny` gives the same layout with small sizes, for a
smoke run on the CPU.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import torch

_GEMMA_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 4  # EmbeddingGemma's 5 to 1
_GEMMA_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


@dataclasses.dataclass(frozen=True)
class Shape:
    arch: str          # bert, mpnet, modernbert, gemma3, mistral, qwen3
    model: str         # the real model the shape copies
    dims: dict         # its config.json's sizes and attention pattern
    tiny: dict         # the same pattern, small (the CPU smoke run)
    pooling: str       # 1_Pooling's mode: cls_token, mean_tokens or lasttoken
    max_seq_length: int
    tokenizer: str     # wordpiece (BERT's), mpnet (MPNet's own) or bpe (a tokenizer.json: real or stand-in)
    dense: tuple = ()  # (in, out) of each Dense module after pooling: identity, no bias, as EmbeddingGemma's
    dtype: torch.dtype = torch.float32  # the real checkpoint's weights
    template: str = ""  # the real tokenizer's special tokens around a text, applied to a BPE that has them


SHAPES = {
    "mpnet-base": Shape(
        "mpnet", "sentence-transformers/all-mpnet-base-v2",
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
             max_position_embeddings=514, relative_attention_num_buckets=32, layer_norm_eps=1e-5),
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=514, relative_attention_num_buckets=32, layer_norm_eps=1e-5),
        "mean_tokens", 384, "mpnet"),
    "modernbert-base": Shape(
        "modernbert", "Alibaba-NLP/gte-modernbert-base (answerdotai/ModernBERT-base's config)",
        dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
             max_position_embeddings=8192, local_attention=128, global_attn_every_n_layers=3,
             global_rope_theta=160000.0, local_rope_theta=10000.0, norm_eps=1e-5, norm_bias=False,
             attention_bias=False, mlp_bias=False),
        dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=8192, local_attention=16, global_attn_every_n_layers=3,
             global_rope_theta=160000.0, local_rope_theta=10000.0, norm_bias=False, attention_bias=False,
             mlp_bias=False),
        "cls_token", 8192, "bpe", template="[CLS] $A [SEP]"),
    "embeddinggemma-300m": Shape(
        "gemma3", "google/embeddinggemma-300m",
        dict(hidden_size=768, num_hidden_layers=24, num_attention_heads=3, num_key_value_heads=1, head_dim=256,
             intermediate_size=1152, max_position_embeddings=2048, sliding_window=512, layer_types=_GEMMA_LAYERS,
             query_pre_attn_scalar=256, rope_parameters=_GEMMA_ROPE, use_bidirectional_attention=True,
             rms_norm_eps=1e-6),
        dict(hidden_size=32, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             intermediate_size=48, max_position_embeddings=2048, sliding_window=16, layer_types=_GEMMA_LAYERS[:6],
             query_pre_attn_scalar=16, rope_parameters=_GEMMA_ROPE, use_bidirectional_attention=True),
        "mean_tokens", 2048, "bpe", dense=((768, 3072), (3072, 768)), template="<bos> $A <eos>"),
    "mistral-7b": Shape(
        "mistral", "intfloat/e5-mistral-7b-instruct",
        dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=14336, max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096,
             rms_norm_eps=1e-5),
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096),
        "lasttoken", 4096, "bpe", dtype=torch.bfloat16, template="<s> $A </s>"),
    "bert-base": Shape(
        "bert", "Snowflake/snowflake-arctic-embed-m (BERT-base)",
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
             max_position_embeddings=512),
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=512),
        "cls_token", 512, "wordpiece"),
}
# Qwen3-Embedding's three sizes (load/bench_fp8.py), with the real Qwen3 tokenizer.json as their BPE.
_QWEN3 = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
              rope_theta=1000000.0, rms_norm_eps=1e-6)
_QWEN3_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, max_position_embeddings=32768, rope_theta=1000000.0)
for _name, _dims in (("qwen3-0.6b", dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                         intermediate_size=3072)),
                     ("qwen3-4b", dict(_QWEN3, hidden_size=2560, num_hidden_layers=36, intermediate_size=9728)),
                     ("qwen3-8b", dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, intermediate_size=12288))):
    SHAPES[_name] = Shape("qwen3", f"Qwen/Qwen3-Embedding-{_name[6:].upper()}", _dims, _QWEN3_TINY, "lasttoken", 8192,
                          "bpe", dtype=torch.bfloat16)
# What load/bench_models.py runs unless told otherwise (the Qwen3 shapes have their own benchmarks).
MODELS_SHAPES = ("mpnet-base", "modernbert-base", "embeddinggemma-300m", "mistral-7b", "bert-base")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Where a shape's tokenizer comes from. `bert_dir`: a BERT WordPiece tokenizer directory
    (all-MiniLM-L6-v2's, whose vocabulary is bert-base-uncased's): BERT-base's own tokenizer, and
    MPNet's, which is that vocabulary behind <s> <pad> </s> <unk> and before <mask> with the same
    lower-casing WordPiece (all-mpnet-base-v2's tokenizer.json gives the same ids). `bpe_file`: a
    tokenizer.json for the BPE shapes, `bpe_label` saying what it is (the real Qwen3 one is a
    stand-in for ModernBERT's, Gemma's and Mistral's byte-level or SentencePiece BPEs; a shape's
    own file makes it real). Neither file, on the CPU only: a 400-token byte-level BPE trained here."""
    bert_dir: str
    bpe_file: str | None = None
    bpe_label: str = ""

    def label(self, shape: Shape) -> str:
        if shape.tokenizer == "wordpiece":
            return "BERT's uncased WordPiece (real)"
        if shape.tokenizer == "mpnet":
            return "MPNet's WordPiece (real)"
        return self.bpe_label if self.bpe_file else "a 400-token byte-level BPE trained here (stand-in)"

    def tag(self, shape: Shape) -> str:
        """A short name for the checkpoint's folder: the vocabulary, and so the weights, depend on it."""
        if shape.tokenizer != "bpe":
            return shape.tokenizer
        if not self.bpe_file:
            return "bpe400"
        with open(self.bpe_file, "rb") as f:
            return "bpe-" + hashlib.sha1(f.read()).hexdigest()[:10]


def make_checkpoint(name: str, root: str, tokenizer: Tokenizer, tiny: bool = False, device: str = "cpu",
                    seed: int = 0) -> str:
    """Write the shape's folder (once) and return it."""
    shape = SHAPES[name]
    path = os.path.join(root, f"{name}{'-tiny' if tiny else ''}-{tokenizer.tag(shape)}")
    if os.path.exists(os.path.join(path, "modules.json")):  # written last
        return path
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    vocab, pad = write_tokenizer(shape, path, tokenizer)
    torch.manual_seed(seed)
    model = hf_model(shape, shape.tiny if tiny else shape.dims, vocab, pad, device)
    model.save_pretrained(path, max_shard_size="5GB")
    width = model.config.hidden_size
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    dense = [(i * width // 768, o * width // 768) for i, o in shape.dense] if tiny else list(shape.dense)
    write_st_files(path, shape, width, dense)
    return path


def hf_model(shape: Shape, dims: dict, vocab: int, pad: int, device: str) -> torch.nn.Module:
    """The transformers model, drawn on `device` directly in the checkpoint's dtype (HF's init: normal
    weights), its norm weights moved away from 1 so that a dropped or swapped norm would show."""
    import transformers as tf

    config_class, model_class = {"bert": (tf.BertConfig, tf.BertModel), "mpnet": (tf.MPNetConfig, tf.MPNetModel),
                                 "modernbert": (tf.ModernBertConfig, tf.ModernBertModel),
                                 "gemma3": (tf.Gemma3TextConfig, tf.Gemma3TextModel),
                                 "mistral": (tf.MistralConfig, tf.MistralModel),
                                 "qwen3": (tf.Qwen3Config, tf.Qwen3Model)}[shape.arch]
    ids = {"pad_token_id": pad}
    if shape.arch == "modernbert":  # its defaults are the GPT-NeoX ids, past a smaller vocabulary
        ids |= {"bos_token_id": None, "eos_token_id": None, "cls_token_id": None, "sep_token_id": None}
    config = config_class(vocab_size=vocab, **dims, **ids)
    default = torch.get_default_dtype()
    torch.set_default_dtype(shape.dtype)
    try:
        with torch.device(device):
            model = model_class(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("LayerNorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def write_tokenizer(shape: Shape, path: str, tokenizer: Tokenizer) -> tuple[int, int]:
    """The shape's tokenizer files into `path`; returns the vocabulary size and the padding id."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import processors
    from transformers import MPNetTokenizer, PreTrainedTokenizerFast

    if shape.tokenizer == "wordpiece":
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            if os.path.exists(os.path.join(tokenizer.bert_dir, name)):
                shutil.copy(os.path.join(tokenizer.bert_dir, name), os.path.join(path, name))
        tok = HfTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        return tok.get_vocab_size(), tok.token_to_id("[PAD]")
    if shape.tokenizer == "mpnet":
        with open(os.path.join(tokenizer.bert_dir, "vocab.txt"), encoding="utf-8") as f:
            words = [w for w in f.read().splitlines() if w]
        vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", *words, "<mask>"])}
        MPNetTokenizer(vocab=vocab, unk_token="[UNK]", model_max_length=shape.max_seq_length).save_pretrained(path)
        return len(vocab), vocab["<pad>"]
    if tokenizer.bpe_file is None:
        from tests.st_models import save_bpe_tokenizer

        first, last = shape.template.split(" $A ") if shape.template else ("<s>", "</s>")
        save_bpe_tokenizer(path, shape.template or "$A", bos=first, eos=last)
        tok = HfTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        return tok.get_vocab_size(), tok.token_to_id("<pad>")
    tok = HfTokenizer.from_file(tokenizer.bpe_file)
    specials = shape.template.split(" $A ") if shape.template else []
    if specials and all(tok.token_to_id(s) is not None for s in specials):
        # The real model's special tokens, where this vocabulary has them (Gemma's own; Llama's for Mistral).
        tok.post_processor = processors.TemplateProcessing(
            single=shape.template, special_tokens=[(s, tok.token_to_id(s)) for s in specials])
    pad = next(t for t in ("<pad>", "[PAD]", "<|endoftext|>", "<unk>", "</s>") if tok.token_to_id(t) is not None)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad,
                            model_max_length=shape.max_seq_length).save_pretrained(path)
    return tok.get_vocab_size(), tok.token_to_id(pad)


def write_st_files(path: str, shape: Shape, width: int, dense: list[tuple[int, int]]) -> None:
    """sentence-transformers' module files in the form the real hub folders have them (the form every
    sentence-transformers release reads): Transformer, Pooling, Dense..., Normalize."""
    from safetensors.torch import save_file

    def dump(name: str, value) -> None:
        os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
        with open(os.path.join(path, name), "w") as f:
            json.dump(value, f, indent=2)

    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    dump("1_Pooling/config.json", {"word_embedding_dimension": width, "include_prompt": True,
                                   **{f"pooling_mode_{m}": m == shape.pooling for m in modes}})
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")]
    for k, (i, o) in enumerate(dense, start=2):
        folder = f"{k}_Dense"
        dump(f"{folder}/config.json", {"in_features": i, "out_features": o, "bias": False,
                                       "activation_function": "torch.nn.modules.linear.Identity"})
        weight = torch.randn(o, i) / i ** 0.5  # keeps the rows' scale
        save_file({"linear.weight": weight}, os.path.join(path, folder, "model.safetensors"))
        modules.append((folder, "Dense"))
    folder = f"{len(modules)}_Normalize"
    os.makedirs(os.path.join(path, folder), exist_ok=True)
    modules.append((folder, "Normalize"))
    dump("sentence_bert_config.json", {"max_seq_length": shape.max_seq_length, "do_lower_case": False})
    dump("modules.json", [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{kind}"}
                          for i, (p, kind) in enumerate(modules)])
