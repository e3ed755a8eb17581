"""sentence-transformers Dense modules after pooling (worker/models/dense.py) against
`SentenceTransformer(dir).encode` on tiny random BERT checkpoints that sentence-transformers saved:
identity and tanh (and others), with and without bias, chained, with a residual, with Normalize
after, cut to Matryoshka sizes; in the engine and through `pollen serve` over HTTP."""
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
from tests.st_models import BERT_VOCAB, assert_rows_match, copy_bert_tokenizer, engine_rows, save_st, texts, token_ids

TEXTS = texts([1, 3, 9, 40, 2, 25, 90])  # the longest is past 100 tokens


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny random BERT (hidden 32) with all-MiniLM-L6-v2's tokenizer, saved by transformers."""
    import transformers as tf

    from tests.st_models import randomize

    path = tmp_path_factory.mktemp("hf-bert")
    torch.manual_seed(0)
    model = tf.BertModel(tf.BertConfig(vocab_size=BERT_VOCAB, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=64, max_position_embeddings=256))
    randomize(model)
    model.eval().save_pretrained(str(path))
    copy_bert_tokenizer(path)
    return path


def dense(in_features, out_features, activation="Identity", bias=True, residual=False, seed=1):
    """A sentence_transformers Dense module with random weights (a real bias, not zeros)."""
    from sentence_transformers import models

    torch.manual_seed(seed)
    module = models.Dense(in_features, out_features, bias=bias, activation_function=getattr(torch.nn, activation)(),
                          use_residual=residual)
    with torch.no_grad():
        module.linear.weight.normal_(0, 0.3)
        if bias:
            module.linear.bias.normal_(0, 0.3)
    return module


CASES = {
    # name: (Dense modules, Normalize after)
    "identity with bias": (lambda: [dense(32, 48)], False),
    "tanh without bias, normalized": (lambda: [dense(32, 48, "Tanh", bias=False)], True),
    "tanh then identity without bias, normalized": (lambda: [dense(32, 64, "Tanh"), dense(64, 40, bias=False)], True),
    "gelu with a projected residual": (lambda: [dense(32, 48, "GELU", residual=True)], False),
    "relu with its own residual": (lambda: [dense(32, 32, "ReLU", residual=True)], False),
}


@pytest.mark.parametrize("case", CASES)
def test_dense_modules_match_sentence_transformers(bert_dir, tmp_path, case):
    modules, normalize = CASES[case]
    modules = modules()
    reference = save_st(tmp_path / "st", bert_dir, "mean", dense=modules, normalize=normalize)
    spec = read_model_spec(str(tmp_path / "st"))
    assert [(d.in_features, d.out_features) for d in spec.dense] == [(m.in_features, m.out_features) for m in modules]
    assert spec.hidden_size == spec.output_dims == modules[-1].out_features
    model = load_model(str(tmp_path / "st"))
    ours = engine_rows(model, token_ids(tmp_path / "st", TEXTS), normalize=normalize)
    want = reference.encode(TEXTS, convert_to_numpy=True)
    assert ours.shape == (len(TEXTS), modules[-1].out_features)
    assert_rows_match(ours, want, lengths=True)  # normalized on both sides, or on neither


def test_matryoshka_sizes_are_of_the_last_dense_output(bert_dir, tmp_path):
    """Sizes in config.json are cut to the Dense output's width (not the encoder's), and a prefix
    of the rows equals sentence-transformers' truncate_dim."""
    reference = save_st(tmp_path / "st", bert_dir, "cls", dense=[dense(32, 64, "Tanh")])
    config = json.loads((tmp_path / "st" / "config.json").read_text())
    (tmp_path / "st" / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [48, 40, 32, 128]}))
    spec = read_model_spec(str(tmp_path / "st"))
    assert spec.matryoshka_dimensions == (32, 40, 48, 64)
    ours = engine_rows(load_model(str(tmp_path / "st")), token_ids(tmp_path / "st", TEXTS))
    for dims in (32, 48):
        assert_rows_match(ours[:, :dims], reference.encode(TEXTS, truncate_dim=dims), lengths=True)


def test_a_dense_module_saved_as_pytorch_model_bin_loads(bert_dir, tmp_path):
    """Older sentence-transformers releases saved Dense weights as pytorch_model.bin."""
    from sentence_transformers import SentenceTransformer

    save_st(tmp_path / "st", bert_dir, "mean", dense=[dense(32, 40, "Tanh")])
    module = SentenceTransformer(str(tmp_path / "st"), device="cpu")[2]
    (tmp_path / "st" / "2_Dense" / "model.safetensors").unlink()
    module.save(str(tmp_path / "st" / "2_Dense"), safe_serialization=False)
    assert (tmp_path / "st" / "2_Dense" / "pytorch_model.bin").exists()
    reference = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    ours = engine_rows(load_model(str(tmp_path / "st")), token_ids(tmp_path / "st", TEXTS))
    assert_rows_match(ours, reference.encode(TEXTS), lengths=True)


# ---------------------------------------------------------------- refusals, each naming what it refuses


@pytest.fixture
def st_dir(bert_dir, tmp_path):
    save_st(tmp_path / "st", bert_dir, "mean", dense=[dense(32, 40, "Tanh")], normalize=True)
    return tmp_path / "st"


def edit_json(file, **changes):
    value = json.loads(file.read_text())
    value.update(changes) if isinstance(value, dict) else None
    file.write_text(json.dumps(value))


def test_an_activation_outside_torch_nn_is_refused(st_dir):
    edit_json(st_dir / "2_Dense" / "config.json", activation_function="my_package.Swish")
    with pytest.raises(UnsupportedModel, match=r"2_Dense/config.json activation_function 'my_package.Swish'"):
        read_model_spec(str(st_dir))
    edit_json(st_dir / "2_Dense" / "config.json", activation_function="torch.nn.modules.activation.PReLU")
    with pytest.raises(UnsupportedModel, match="PReLU"):  # it has weights of its own
        read_model_spec(str(st_dir))


def test_dense_shapes_and_tensors_are_checked_at_start(st_dir):
    from safetensors.torch import load_file, save_file

    edit_json(st_dir / "2_Dense" / "config.json", in_features=16)
    with pytest.raises(UnsupportedModel, match="in_features 16 does not match the 32 values it reads"):
        read_model_spec(str(st_dir))
    edit_json(st_dir / "2_Dense" / "config.json", in_features=32, out_features=24)
    with pytest.raises(UnsupportedModel, match=r"tensor linear.weight has shape \(40, 32\), .* implies \(24, 32\)"):
        read_model_spec(str(st_dir))
    edit_json(st_dir / "2_Dense" / "config.json", out_features=40)
    tensors = load_file(str(st_dir / "2_Dense" / "model.safetensors"))
    save_file({"linear.weight": tensors["linear.weight"]}, str(st_dir / "2_Dense" / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match="2_Dense/model.safetensors lacks tensor linear.bias"):
        read_model_spec(str(st_dir))


def test_a_bin_dense_file_lacking_a_tensor_is_refused_by_the_loader(st_dir):
    from safetensors.torch import load_file

    weights = load_file(str(st_dir / "2_Dense" / "model.safetensors"))
    (st_dir / "2_Dense" / "model.safetensors").unlink()
    torch.save({"linear.weight": weights["linear.weight"]}, str(st_dir / "2_Dense" / "pytorch_model.bin"))
    read_model_spec(str(st_dir))  # a .bin is read by the worker only
    with pytest.raises(UnsupportedModel, match="2_Dense/pytorch_model.bin lacks tensor linear.bias"):
        load_model(str(st_dir))


def test_module_order_pollen_cannot_compute_is_refused(st_dir):
    modules = json.loads((st_dir / "modules.json").read_text())
    transformer, pooling, dense_module, normalize = modules
    for order, message in [([transformer, dense_module, pooling, normalize], "Dense module before Pooling"),
                           ([transformer, pooling, normalize, dense_module], "after Normalize")]:
        (st_dir / "modules.json").write_text(json.dumps(order))
        with pytest.raises(UnsupportedModel, match=message):
            read_model_spec(str(st_dir))
    (st_dir / "modules.json").write_text(json.dumps(modules))
    edit_json(st_dir / "2_Dense" / "config.json", module_input_name="token_embeddings")
    with pytest.raises(UnsupportedModel, match="module_input_name 'token_embeddings'"):
        read_model_spec(str(st_dir))


def test_an_unknown_or_foreign_module_is_named(st_dir):
    modules = json.loads((st_dir / "modules.json").read_text())
    for kind in ("sentence_transformers.models.LayerNorm", "custom_st.Transformer"):
        extra = {"idx": 0, "name": "0", "path": "", "type": kind}
        (st_dir / "modules.json").write_text(json.dumps([extra] + modules[1:]))
        with pytest.raises(UnsupportedModel, match=f"module '{kind}' is not supported"):
            read_model_spec(str(st_dir))


# ---------------------------------------------------------------- through the server


def post(srv, body: dict) -> dict:
    request = urllib.request.Request(f"http://{srv.http_listen}/v1/embeddings", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def rows(answer: dict) -> np.ndarray:
    return np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)


def test_http_answers_equal_sentence_transformers_with_dense_modules(bert_dir, tmp_path):
    """Two Dense modules (tanh with bias, identity without) and no Normalize: the served vectors,
    raw and cut to a Matryoshka size, are sentence-transformers' own."""
    path = tmp_path / "tiny-dense"
    reference = save_st(path, bert_dir, "mean", dense=[dense(32, 64, "Tanh"), dense(64, 48, bias=False, seed=2)])
    srv = ServerProcess("--model", str(path)).start(timeout=60)
    try:
        raw = post(srv, {"input": TEXTS, "normalize": False})
        cut = post(srv, {"input": TEXTS, "normalize": False, "dimensions": 32})
        models = json.loads(urllib.request.urlopen(f"http://{srv.http_listen}/v1/models", timeout=30).read())
    finally:
        assert srv.terminate() == 0
    assert_rows_match(rows(raw), reference.encode(TEXTS), lengths=True)
    assert_rows_match(rows(cut), reference.encode(TEXTS, truncate_dim=32), lengths=True)
    assert models["data"][0]["dimensions"] == 48
