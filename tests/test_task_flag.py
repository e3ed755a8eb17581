"""--task's reading of a checkpoint (read_model_spec(task=...)): what each model serves, in place of
what its files say, and why; a task the checkpoint cannot serve is refused naming the model, the
flag and why."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from pollen.common.model_spec import UnsupportedModel, read_model_spec
from tests.test_rerank_models import (
    make_encoder_classifier,
    qwen3_config,
    randomize,
    save_reranker_tokenizer,
)

# ---------------------------------------------------------------- what a checkpoint can serve


def causal_lm(path, yes_no=True):
    """A tiny random Qwen3ForCausalLM with the reranker prompts' tokenizer; the transformers model."""
    import transformers as tf
    from tokenizers import Tokenizer, models

    torch.manual_seed(3)
    hf = tf.Qwen3ForCausalLM(qwen3_config())
    randomize(hf)
    hf.eval().save_pretrained(str(path))
    if yes_no:
        save_reranker_tokenizer(path)
    else:
        Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(path / "tokenizer.json"))
    return hf


def bert_embedder(path):
    import transformers as tf

    tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                               vocab_size=400, max_position_embeddings=64)).save_pretrained(str(path))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    causal_lm(root / "qwen3-ft")
    causal_lm(root / "no-yes-no", yes_no=False)
    bert_embedder(root / "bert")
    make_encoder_classifier(root / "cross-encoder", "bert", ())
    make_encoder_classifier(root / "nli", "bert", ("neg", "neutral", "pos"))
    return root


@pytest.mark.parametrize("model, task, found, reason", [
    ("qwen3-ft", "auto", "embed", "from the folder name ('qwen3-ft' does not say reranker: Qwen3ForCausalLM as an "
                                  "embedder; --task rerank serves it as Qwen3-Reranker)"),
    ("qwen3-ft", "rerank", "rerank", "from --task (Qwen3ForCausalLM as Qwen3-Reranker)"),
    ("qwen3-ft", "embed", "embed", "from --task (Qwen3ForCausalLM: no head)"),
    ("bert", "auto", "embed", "from the architecture (BertModel: no head)"),
    ("cross-encoder", "auto", "rerank", "from the head (BertForSequenceClassification, one output)"),
    ("cross-encoder", "rerank", "rerank", "from --task (BertForSequenceClassification, one output)"),
    ("nli", "auto", "classify", "from the head (BertForSequenceClassification, 3 labels)"),
])
def test_each_task_says_why(checkpoints, model, task, found, reason):
    spec = read_model_spec(str(checkpoints / model), task=task)
    assert (spec.task, spec.task_reason) == (found, reason)
    assert spec.reranker_template == (model == "qwen3-ft" and task == "rerank")


@pytest.mark.parametrize("model, task, why", [
    ("bert", "rerank", "--task rerank is refused: it has no one-output classification head and is no "
                       "Qwen3ForCausalLM to serve as Qwen3-Reranker (architectures: BertModel)"),
    ("bert", "classify", "--task classify is refused: it has no classification head with labels "
                         "(architectures: BertModel)"),
    ("qwen3-ft", "classify", "--task classify is refused: it has no classification head with labels "
                             "(architectures: Qwen3ForCausalLM)"),
    ("cross-encoder", "classify", "--task classify is refused: its BertForSequenceClassification head has one "
                                  "output, so it serves rerank"),
    ("cross-encoder", "embed", "--task embed is refused: its BertForSequenceClassification head has one output, "
                               "so it serves rerank; pollen does not serve its encoder without the head"),
    ("nli", "rerank", "--task rerank is refused: its BertForSequenceClassification head has 3 labels, so it "
                      "serves classify"),
    ("no-yes-no", "rerank", "--task rerank is refused: a Qwen3 reranker's tokenizer.json needs the tokens 'yes' "
                            "and 'no'"),
])
def test_a_task_the_checkpoint_cannot_serve_is_refused_naming_why(checkpoints, model, task, why):
    path = str(checkpoints / model)
    with pytest.raises(UnsupportedModel) as refused:
        read_model_spec(path, task=task)
    assert str(refused.value) == f"{path}: {why}"
