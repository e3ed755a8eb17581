"""Our packed DistilBERT (the BERT encoder under DistilBERT's names, without token types) against
`SentenceTransformer(dir).encode` on tiny random checkpoints that sentence-transformers saved
(msmarco-distilbert-* and multi-qa-distilbert-* are mean- and CLS-pooled)."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json

import pytest
import torch

from pollen.common.model_spec import UnsupportedModel, read_model_spec
from pollen.worker.models.loader import load_model
from tests.st_models import (
    BERT_VOCAB,
    assert_rows_match,
    copy_bert_tokenizer,
    engine_rows,
    randomize,
    save_st,
    texts,
    token_ids,
)

TEXTS = texts([1, 4, 12, 40, 2, 25, 60])  # 3 to over 100 tokens, within the 128 positions


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def make_distilbert(path, kind: str = "model"):
    """A tiny random DistilBertModel (or DistilBertForMaskedLM: names under "distilbert.") with
    all-MiniLM-L6-v2's tokenizer."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.DistilBertConfig(vocab_size=BERT_VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                 max_position_embeddings=128)
    model = (tf.DistilBertForMaskedLM if kind == "mlm" else tf.DistilBertModel)(config)
    randomize(model)
    model.eval().save_pretrained(str(path))
    copy_bert_tokenizer(path)
    return model


@pytest.mark.parametrize("pooling,kind", [("mean", "model"), ("cls", "model"), ("mean", "mlm")])
def test_distilbert_matches_sentence_transformers(tmp_path, pooling, kind):
    make_distilbert(tmp_path / "hf", kind)
    reference = save_st(tmp_path / "st", tmp_path / "hf", pooling)
    spec = read_model_spec(str(tmp_path / "st"))
    assert (spec.family, spec.hidden_size, spec.pooling) == ("bert", 32, pooling)
    model = load_model(str(tmp_path / "st"))
    assert model.token_type is None  # DistilBERT has no token type embeddings to add
    sequences = token_ids(tmp_path / "st", TEXTS)
    assert max(len(s) for s in sequences) <= 128
    want = reference.encode(TEXTS, convert_to_numpy=True)
    assert_rows_match(engine_rows(model, sequences), want, lengths=True)


def test_a_distilbert_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_distilbert(tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["transformer.layer.1.ffn.lin2.bias"]
    save_file(tensors, str(file))
    with pytest.raises(UnsupportedModel, match=r"transformer\.layer\.1\.ffn\.lin2\.bias"):
        load_model(str(tmp_path / "m"))


def test_a_distilbert_classifier_is_refused_not_served_as_an_embedder(tmp_path):
    """Its pre_classifier + ReLU head is not implemented; serving it as an embedder would drop it."""
    import transformers as tf

    config = tf.DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=4, hidden_dim=64, num_labels=1)
    tf.DistilBertForSequenceClassification(config).save_pretrained(str(tmp_path / "m"))
    with pytest.raises(UnsupportedModel, match="DistilBertForSequenceClassification head is not supported"):
        read_model_spec(str(tmp_path / "m"))


def test_distilbert_relu_is_refused(tmp_path):
    make_distilbert(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "activation": "relu"}))
    with pytest.raises(UnsupportedModel, match="hidden_act 'relu' is not supported"):
        read_model_spec(str(tmp_path / "m"))
