"""Gemma3 text models (EmbeddingGemma's `gemma3_text`) against `SentenceTransformer(dir).encode`
on tiny random checkpoints that sentence-transformers saved in EmbeddingGemma's form: bidirectional
layers (use_bidirectional_attention), sliding layers between global ones with a window shorter
than the longer texts, an attention scale of its own (query_pre_attn_scalar), mean pooling, two
Dense modules without bias and a Normalize, its task prompts; Matryoshka prefixes; a causal
Gemma3 with last-token pooling; the configs pollen cannot compute, refused by name; and one
checkpoint through `pollen serve` over HTTP."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json

import numpy as np
import pytest
import torch

from pollen.common.model_spec import UnsupportedModel, read_model_spec
from pollen.worker.models.attention import VarlenAttention
from pollen.worker.models.loader import load_model
from tests.conftest import ServerProcess
from tests.st_models import assert_rows_match, engine_rows, randomize, save_bpe_tokenizer, save_st, texts, token_ids
from tests.test_dense_modules import dense
from tests.test_model_decoders import edit_config, post

TEXTS = texts([1, 3, 9, 30, 2, 20, 45])  # 4 to about 100 tokens: past the window of 8, through every layer
# EmbeddingGemma's prompts (config_sentence_transformers.json), two of them.
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}
# Sliding layers around a global one, as Gemma3's pattern has them (5 to 1 in EmbeddingGemma).
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, layer_types=LAYER_TYPES, sliding_window=8,
             query_pre_attn_scalar=24, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                        "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 1e4}})


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def make_gemma3(path, bidirectional: bool = True, **extra):
    """A tiny random HF Gemma3TextModel with a Gemma-style tokenizer ("<bos> $A <eos>") in `path`."""
    import transformers as tf

    vocab = save_bpe_tokenizer(path, "<bos> $A <eos>", bos="<bos>", eos="<eos>")
    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(**{**SHAPE, "vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 1,
                                    "pad_token_id": 2, "use_bidirectional_attention": bidirectional, **extra})
    model = tf.Gemma3TextModel(config).eval()
    randomize(model)
    model.save_pretrained(str(path))
    return model


def make_embedding_gemma(tmp_path, name: str = "st", **extra):
    """EmbeddingGemma's folder: mean pooling, Dense hidden -> 4 x hidden and back (identity, no
    bias; 768 -> 3072 -> 768 in EmbeddingGemma), Normalize, its prompts; returns (folder, reference)."""
    make_gemma3(tmp_path / "hf", **extra)
    hidden = extra.get("hidden_size", SHAPE["hidden_size"])
    modules = [dense(hidden, 4 * hidden, bias=False, seed=1), dense(4 * hidden, hidden, bias=False, seed=2)]
    path = tmp_path / name
    reference = save_st(path, tmp_path / "hf", "mean", dense=modules, normalize=True, prompts=PROMPTS)
    return path, reference


def test_embedding_gemma_matches_sentence_transformers(tmp_path):
    path, reference = make_embedding_gemma(tmp_path)
    spec = read_model_spec(str(path))
    assert (spec.family, spec.causal, spec.pooling, spec.hidden_size) == ("gemma3", False, "mean", 64)
    assert len(spec.dense) == 2 and dict(spec.prompts) == PROMPTS
    model = load_model(str(path))
    assert [attention.window for attention in model.attention.values()] == [None, 4]  # 8 // 2 either side
    sequences = token_ids(path, TEXTS)
    assert min(len(s) for s in sequences) < 5 and max(len(s) for s in sequences) > 8 * 4
    plain = engine_rows(model, sequences, normalize=True)
    assert_rows_match(plain, reference.encode(TEXTS), lengths=True)
    prompted = engine_rows(model, token_ids(path, TEXTS, prompt=PROMPTS["query"]), normalize=True)
    assert_rows_match(prompted, reference.encode(TEXTS, prompt_name="query"), lengths=True)
    # Matryoshka: sentence-transformers cuts the normalized row; the direction is the cut raw row's.
    cut = engine_rows(model, token_ids(path, TEXTS, prompt=PROMPTS["document"]))[:, :32]
    assert_rows_match(cut, reference.encode(TEXTS, prompt_name="document", truncate_dim=32), lengths=False)


def test_the_window_and_the_attention_scale_change_the_rows(tmp_path):
    """Without the window, or with the default 1/sqrt(head_dim) scale, the rows differ from the
    reference: the test above could fail on either."""
    path, reference = make_embedding_gemma(tmp_path)
    sequences = token_ids(path, TEXTS)
    expected = reference.encode(TEXTS)
    far = [i for i, s in enumerate(sequences) if len(s) > 9]
    unwindowed = load_model(str(path))
    unwindowed.attention[True] = VarlenAttention(unwindowed.attention[True].kind)
    assert not np.allclose(engine_rows(unwindowed, sequences, normalize=True)[far], expected[far], atol=1e-3)
    edit_config(path, query_pre_attn_scalar=16)  # the head_dim: what a scale left at its default computes
    assert not np.allclose(engine_rows(load_model(str(path)), sequences, normalize=True), expected, atol=1e-3)


@pytest.mark.parametrize("case", ["old rope keys", "no layer_types", "biases"])
def test_config_forms_match_sentence_transformers(tmp_path, case):
    """transformers 4's keys (rope_theta for the global layers, rope_local_base_freq for the
    sliding ones), the sliding-window pattern in place of layer_types, q/k/v/o biases."""
    extra = {"biases": {"attention_bias": True}}.get(case, {})
    make_gemma3(tmp_path / "hf", **extra)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if case == "old rope keys":
        config.pop("rope_parameters")
        config |= {"rope_theta": 5e5, "rope_local_base_freq": 3e3}
    if case == "no layer_types":
        config.pop("layer_types")
        config["sliding_window_pattern"] = 3  # sliding, sliding, full, sliding
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    reference = save_st(tmp_path / "st", tmp_path / "hf", "mean")
    model = load_model(str(tmp_path / "st"))
    assert [layer.sliding for layer in model.layers] == [True, True, False, True]
    if case == "biases":
        assert model.layers[0].o.bias is not None and model.layers[0].qkv.bias.abs().max() > 0
    assert_rows_match(engine_rows(model, token_ids(tmp_path / "st", TEXTS)), reference.encode(TEXTS), lengths=True)


def test_causal_gemma3_matches_sentence_transformers(tmp_path):
    """Without use_bidirectional_attention the layers read causally, and a sliding layer's token
    sees itself and the sliding_window - 1 tokens before it; last-token pooling is the default."""
    make_gemma3(tmp_path / "hf", bidirectional=False)
    reference = save_st(tmp_path / "st", tmp_path / "hf", "lasttoken")
    spec = read_model_spec(str(tmp_path / "st"))
    assert spec.causal and spec.pooling == "last"
    model = load_model(str(tmp_path / "st"))
    assert model.attention[True].window == 7
    expected = reference.encode(TEXTS)
    assert_rows_match(engine_rows(model, token_ids(tmp_path / "st", TEXTS)), expected, lengths=True)
    # `--attention causal` on the bidirectional checkpoint (the same weights) serves it as
    # transformers would with the flag off: the causal window too.
    make_gemma3(tmp_path / "bidirectional")
    flipped = load_model(str(tmp_path / "bidirectional"), attention="causal", pooling="last")
    assert flipped.attention[True].window == 7
    assert_rows_match(engine_rows(flipped, token_ids(tmp_path / "st", TEXTS)), expected, lengths=True)


@pytest.fixture
def gemma3_dir(tmp_path):
    make_gemma3(tmp_path / "m")
    return tmp_path / "m"


def test_final_logit_softcapping_is_read_as_what_it_is(gemma3_dir):
    """It caps the language-model head's logits, which an embedder never computes: served."""
    edit_config(gemma3_dir, final_logit_softcapping=30.0)
    assert read_model_spec(str(gemma3_dir)).family == "gemma3"


@pytest.mark.parametrize("change,message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0}}},
     "RoPE type 'yarn' is not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types must list one of"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"architectures": ["Gemma3TextForSequenceClassification"]},
     "Gemma3TextForSequenceClassification head is not supported"),
])
def test_gemma3_configs_pollen_cannot_compute_are_refused(gemma3_dir, change, message):
    edit_config(gemma3_dir, **change)
    with pytest.raises(UnsupportedModel, match=message):
        read_model_spec(str(gemma3_dir))


# ---------------------------------------------------------------- through the server


def test_http_answers_equal_sentence_transformers_for_embedding_gemma(tmp_path):
    """EmbeddingGemma's folder through `pollen serve`: plain texts, the query prompt by name, a
    Matryoshka prefix, and vectors unnormalized (the Dense modules' output as it is)."""
    path, reference = make_embedding_gemma(tmp_path, name="tiny-embeddinggemma")
    srv = ServerProcess("--model", str(path)).start(timeout=60)
    try:
        plain = post(srv, {"input": TEXTS})
        queries = post(srv, {"input": TEXTS, "prompt_name": "query", "dimensions": 32})
        raw = post(srv, {"input": TEXTS, "normalize": False, "prompt": PROMPTS["document"]})
    finally:
        assert srv.terminate() == 0
    assert_rows_match(plain, reference.encode(TEXTS), lengths=True)
    # The server normalizes the cut rows; sentence-transformers cuts normalized rows: the same directions.
    assert_rows_match(queries, reference.encode(TEXTS, prompt_name="query", truncate_dim=32), lengths=False)
    np.testing.assert_allclose(np.linalg.norm(queries, axis=1), 1.0, atol=1e-5)
    assert_rows_match(raw, reference.encode(TEXTS, prompt_name="document"), lengths=False)
    assert np.linalg.norm(raw, axis=1).std() > 1e-3  # not normalized: the lengths vary
