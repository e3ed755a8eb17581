"""The decoders on the Qwen3 layers without QK-norm: Qwen2 (q/k/v biases), Mistral and Llama
(attention_bias; default, linear and llama3 RoPE), against `SentenceTransformer(dir).encode` on
tiny random checkpoints that sentence-transformers saved, with a byte-level BPE tokenizer that
adds the model's special tokens: last-token and mean pooling, instruction prompts, Matryoshka
prefixes; `--attention bidirectional` against HF transformers with an all-true mask; the configs
pollen cannot compute, refused by name; and one checkpoint through `pollen serve` over HTTP."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import urllib.request

import numpy as np
import pytest
import torch

from pollen.common.model_spec import UnsupportedModel, read_model_spec
from pollen.worker.models.loader import load_model
from tests.conftest import ServerProcess
from tests.st_models import assert_rows_match, engine_rows, randomize, save_bpe_tokenizer, save_st, texts, token_ids

TEXTS = texts([1, 3, 9, 30, 2, 20, 45])  # 3 to about 100 tokens
PROMPTS = {"query": "Instruct: Given a web search query, retrieve relevant passages\nQuery: ", "document": ""}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}
# The tokenizers' special tokens: Qwen's end-of-text after the text, Mistral's and Llama's <s> ... </s>.
TEMPLATES = {"qwen2": "$A <|endoftext|>", "mistral": "<s> $A </s>", "llama": "<s> $A </s>"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def make_decoder(path, model_type: str, **extra):
    """A tiny random HF decoder of `model_type` with its tokenizer in `path`; returns the HF model."""
    import transformers as tf

    vocab = save_bpe_tokenizer(path, TEMPLATES[model_type])
    torch.manual_seed(0)
    config_class, model_class = {"qwen2": (tf.Qwen2Config, tf.Qwen2Model), "mistral": (tf.MistralConfig, tf.MistralModel),
                                 "llama": (tf.LlamaConfig, tf.LlamaModel)}[model_type]
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    model = model_class(config_class(**{**shape, **extra})).eval()
    randomize(model)
    model.save_pretrained(str(path))
    return model


CASES = {
    # name: (model_type, config extras, pooling)
    "qwen2": ("qwen2", {"rope_theta": 1e6}, "lasttoken"),
    "qwen2 mean": ("qwen2", {}, "mean"),
    "mistral": ("mistral", {"sliding_window": None}, "lasttoken"),
    "llama with biases": ("llama", {"attention_bias": True}, "lasttoken"),
    "llama3 rope": ("llama", {"rope_parameters": LLAMA3_ROPE}, "lasttoken"),
    "linear rope": ("llama", {"rope_parameters": LINEAR_ROPE}, "mean"),
}


@pytest.mark.parametrize("case", CASES)
def test_decoder_matches_sentence_transformers(tmp_path, case):
    model_type, extra, pooling = CASES[case]
    make_decoder(tmp_path / "hf", model_type, **extra)
    reference = save_st(tmp_path / "st", tmp_path / "hf", pooling, prompts=PROMPTS)
    spec = read_model_spec(str(tmp_path / "st"))
    assert spec.family == "qwen3" and spec.causal and spec.pooling == {"lasttoken": "last"}.get(pooling, pooling)
    assert dict(spec.prompts) == PROMPTS and spec.max_tokens == 256
    model = load_model(str(tmp_path / "st"))
    assert all(layer.q_norm is None for layer in model.layers)  # no QK-norm in these families
    plain = engine_rows(model, token_ids(tmp_path / "st", TEXTS))
    assert_rows_match(plain, reference.encode(TEXTS), lengths=True)
    prompted = engine_rows(model, token_ids(tmp_path / "st", TEXTS, prompt=PROMPTS["query"]))
    assert_rows_match(prompted, reference.encode(TEXTS, prompt_name="query"), lengths=True)
    assert_rows_match(prompted[:, :32], reference.encode(TEXTS, prompt_name="query", truncate_dim=32), lengths=True)


def test_qwen2_biases_are_loaded(tmp_path):
    """q, k and v have biases and o none, as transformers builds Qwen2 (attention_bias aside)."""
    make_decoder(tmp_path / "m", "qwen2", attention_bias=True)
    layer = load_model(str(tmp_path / "m")).layers[0]
    assert layer.qkv.bias is not None and layer.o.bias is None
    assert layer.qkv.bias.abs().max() > 0  # randomized, and read from the checkpoint


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_attention_bidirectional_matches_hf_with_an_all_true_mask(tmp_path, model_type):
    from tests.test_model_qwen3 import hf_rows

    hf = make_decoder(tmp_path / "m", model_type)
    model = load_model(str(tmp_path / "m"), attention="bidirectional", pooling="mean")
    assert not model.spec.causal
    sequences = token_ids(tmp_path / "m", TEXTS)
    ours = engine_rows(model, sequences)
    assert_rows_match(ours, hf_rows(hf, [torch.from_numpy(s).long() for s in sequences], "bidirectional").numpy(),
                      lengths=True)


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_mistral_sliding_window_matches_sentence_transformers_past_the_window(tmp_path, pooling):
    """A window of 8 against texts of 3 to about 100 tokens: each token sees itself and the 7
    before it, as transformers' sliding-window causal mask reads config.json's sliding_window;
    texts are served up to the position limit, not cut at the window."""
    make_decoder(tmp_path / "hf", "mistral", sliding_window=8)
    reference = save_st(tmp_path / "st", tmp_path / "hf", pooling)
    spec = read_model_spec(str(tmp_path / "st"))
    assert spec.max_tokens == 256
    model = load_model(str(tmp_path / "st"))
    assert model.attention.window == 7
    sequences = token_ids(tmp_path / "st", TEXTS)
    assert max(len(s) for s in sequences) > 8 * 4  # well past the window, through both layers
    assert_rows_match(engine_rows(model, sequences), reference.encode(TEXTS), lengths=True)
    # Without the window the rows past it differ: the test could fail.
    unwindowed = load_model(str(tmp_path / "st"))
    unwindowed.attention = type(model.attention)(model.attention.kind)
    far = [i for i, s in enumerate(sequences) if len(s) > 8]
    assert not np.allclose(engine_rows(unwindowed, sequences)[far], reference.encode(TEXTS)[far], atol=1e-3)


@pytest.fixture
def qwen2_dir(tmp_path):
    make_decoder(tmp_path / "m", "qwen2")
    return tmp_path / "m"


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change,message", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "RoPE type 'yarn' is not supported"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "RoPE 'linear' needs a positive number factor"),
    ({"partial_rotary_factor": 0.5}, "partial rotary embeddings"),
    ({"use_sliding_window": True}, "sliding-window attention layers"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window attention layers"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"architectures": ["Qwen2ForSequenceClassification"]}, "Qwen2ForSequenceClassification head is not supported"),
    ({"auto_map": {"AutoModel": "modeling_qwen.Qwen2Model"}, "architectures": ["Qwen2ForCausalLM"]},
     r"architecture Qwen2ForCausalLM \(model_type 'qwen2'\) runs the checkpoint's own code \(modeling_qwen.Qwen2Model"),
])
def test_decoder_configs_pollen_cannot_compute_are_refused(qwen2_dir, change, message):
    edit_config(qwen2_dir, **change)
    with pytest.raises(UnsupportedModel, match=message):
        read_model_spec(str(qwen2_dir))


# ---------------------------------------------------------------- through the server


def post(srv, body: dict) -> np.ndarray:
    request = urllib.request.Request(f"http://{srv.http_listen}/v1/embeddings", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return np.array([item["embedding"] for item in json.loads(reply.read())["data"]], dtype=np.float32)


def test_http_answers_equal_sentence_transformers_for_a_mistral(tmp_path):
    """e5-mistral's form: last token, "<s> ... </s>", an instruction prompt for queries, none for
    documents (the default prompt here), vectors unnormalized and cut to a Matryoshka size; a
    sliding window shorter than the longer texts."""
    make_decoder(tmp_path / "hf", "mistral", sliding_window=16)  # the longer texts reach past it
    path = tmp_path / "tiny-mistral"
    reference = save_st(path, tmp_path / "hf", "lasttoken", prompts=PROMPTS, default_prompt_name="document")
    srv = ServerProcess("--model", str(path)).start(timeout=60)
    try:
        documents = post(srv, {"input": TEXTS, "normalize": False})
        queries = post(srv, {"input": TEXTS, "normalize": False, "prompt_name": "query", "dimensions": 32})
        literal = post(srv, {"input": TEXTS, "prompt": PROMPTS["query"]})
    finally:
        assert srv.terminate() == 0
    assert_rows_match(documents, reference.encode(TEXTS), lengths=True)
    assert_rows_match(queries, reference.encode(TEXTS, prompt_name="query", truncate_dim=32), lengths=True)
    assert_rows_match(literal, reference.encode(TEXTS, prompt_name="query"), lengths=False)
    np.testing.assert_allclose(np.linalg.norm(literal, axis=1), 1.0, atol=1e-5)  # HTTP normalizes by default
