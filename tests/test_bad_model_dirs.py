"""A model directory pollen cannot serve is refused with one line that names the file and the
problem, and no traceback: what the supervisor can check is checked before any child starts
(common/model_spec.py: config.json's sizes against the weights, every safetensors header against
its file, tokenizer.json parsed), and what only the worker finds (a tensor of the wrong shape)
comes back from it as the server's last line."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess

import pytest

from pollen.common.model_spec import default_model_path
from tests.conftest import POLLEN, free_port

SERVE_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    """A tiny random BERT with all-MiniLM-L6-v2's tokenizer (its ids fit the vocabulary)."""
    import torch
    import transformers as tf

    path = tmp_path_factory.mktemp("model") / "good"
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=128)
    tf.BertModel(config).eval().save_pretrained(str(path))
    shutil.copy(os.path.join(default_model_path(), "tokenizer.json"), path / "tokenizer.json")
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def lying_header(path):
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 60)  # a header longer than any file
    weights.write_bytes(bytes(data))


def huge_header(path):
    # 200 MB of header, over safetensors' own limit, in a file that really holds it.
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", 200_000_000) + b"{")
        f.truncate(8 + 200_000_000)


def truncated(path):
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])


def nested(depth: int, inner: str = "1") -> str:
    return '{"a": ' * depth + inner + "}" * depth


MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]


def with_modules(path, *extra):
    (path / "modules.json").write_text(json.dumps(MODULES + list(extra)))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))


def dense_without_bias_tensor(path):
    """A Dense module whose config says bias and whose weights hold none."""
    import torch
    from safetensors.torch import save_file

    with_modules(path, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "2_Dense").mkdir()
    (path / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 32, "out_features": 16, "bias": True}))
    save_file({"linear.weight": torch.zeros(16, 32)}, str(path / "2_Dense" / "model.safetensors"))


def remote_code(path):
    """jina-embeddings-v2's form: model_type bert, with its ALiBi attention in its own code."""
    edit_config(path, architectures=["JinaBertForMaskedLM"],
                auto_map={"AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig",
                          "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel"})


CASES = {
    # name: (how to break the directory, what the last line must say)
    "hidden_size 10^6": (lambda p: edit_config(p, hidden_size=10**6), ["config.json", "hidden_size 1000000",
                                                                      "safetensors files hold"]),
    "10^4 layers": (lambda p: edit_config(p, num_hidden_layers=10**4), ["config.json", "num_hidden_layers 10000",
                                                                       "safetensors files hold"]),
    "a size that is no number": (lambda p: edit_config(p, intermediate_size="64"), [
        "config.json", "intermediate_size must be a positive integer, got '64'"]),
    "a lying safetensors header": (lying_header, ["model.safetensors", "header length 1152921504606846976"]),
    "a huge safetensors header": (huge_header, ["model.safetensors", "header too large"]),
    "a truncated safetensors file": (truncated, ["model.safetensors", "not fully covered"]),
    "a garbage tokenizer.json": (lambda p: (p / "tokenizer.json").write_text("garbage{"), [
        "tokenizer.json", "expected value"]),
    "a deeply nested tokenizer.json": (lambda p: (p / "tokenizer.json").write_text(nested(100_000)), [
        "tokenizer.json"]),
    "no tokenizer.json": (lambda p: (p / "tokenizer.json").unlink(), ["no tokenizer.json"]),
    "a deeply nested config.json": (lambda p: (p / "config.json").write_text(nested(100_000)), [
        "config.json", "nested too deeply"]),
    "a config.json that is a list": (lambda p: (p / "config.json").write_text("[1, 2]"), [
        "config.json", "is not a JSON object"]),
    "remote code under a supported model_type": (remote_code, [
        "architecture JinaBertForMaskedLM (model_type 'bert')", "modeling_bert.JinaBertModel", "auto_map"]),
    "an unknown model_type": (lambda p: edit_config(p, model_type="nomic_bert"), [
        "model_type 'nomic_bert' is not supported"]),
    "an unknown module in modules.json": (lambda p: with_modules(p, {
        "idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}), [
        "module 'sentence_transformers.models.LayerNorm' is not supported"]),
    "a Dense module lacking a tensor": (dense_without_bias_tensor, ["2_Dense/model.safetensors lacks tensor linear.bias"]),
    "a tokenizer with ids past the vocabulary": (lambda p: edit_config(p, vocab_size=30000), [
        "tokenizer.json", "has id 30521, past the model's vocabulary (config.json vocab_size 30000)"]),
}


def serve(model) -> subprocess.CompletedProcess:
    return subprocess.run([POLLEN, "serve", "--model", str(model), "--listen", f"127.0.0.1:{free_port()}",
                           "--http-listen", f"127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=SERVE_TIMEOUT_S)


@pytest.mark.parametrize("case", CASES)
def test_a_bad_model_directory_is_refused_before_any_child_in_one_line(good_model, tmp_path, case):
    breaks, says = CASES[case]
    model = tmp_path / "model"
    shutil.copytree(good_model, model)
    breaks(model)
    done = serve(model)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert str(model) in last and all(s in last for s in says), last
    assert "Traceback" not in done.stderr and "worker 0 started" not in done.stderr, done.stderr[-3000:]


def test_a_tensor_only_the_worker_finds_wrong_comes_back_as_the_last_line(good_model, tmp_path):
    """intermediate_size 32 where the weights have 64: config and weights agree on what they
    hold overall, and only the worker, building the model, finds the shapes differ."""
    model = tmp_path / "model"
    shutil.copytree(good_model, model)
    edit_config(model, intermediate_size=32)
    done = serve(model)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "worker 0 could not load the model" in last and str(model) in last, last
    assert "has shape (64, 32), config.json implies (32, 32)" in last, last
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_weight_the_checkpoint_lacks_is_named_in_the_last_line(good_model, tmp_path):
    """Never random: a tensor the architecture reads and the checkpoint lacks stops the start, named."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(good_model, model)
    tensors = load_file(str(model / "model.safetensors"))
    del tensors["encoder.layer.1.attention.self.key.weight"]
    save_file(tensors, str(model / "model.safetensors"))
    done = serve(model)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "worker 0 could not load the model" in last and str(model) in last, last
    assert "lacks 1 tensors: encoder.layer.1.attention.self.key.weight" in last, last
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_pollen_download_checks_the_same(good_model, tmp_path):
    """`pollen download` of a local directory refuses what serve would (cli.py)."""
    model = tmp_path / "model"
    shutil.copytree(good_model, model)
    truncated(model)
    done = subprocess.run([POLLEN, "download", str(model)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "model.safetensors" in done.stderr and "Traceback" not in done.stderr, done.stderr
