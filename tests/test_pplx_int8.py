"""pplx-embed's native int8 through the server on a tiny random `bidirectional_pplx_qwen3`
checkpoint: round(127 * tanh(mean pool)) of an HF transformers Qwen3Model made bidirectional.

Needs our Qwen3 model code (worker/models/qwen3.py), which lands separately; until then this
test skips and says so.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import grpc
import numpy as np
import pytest
import torch

from pollen.common.model_spec import default_model_path, read_model_spec
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("worker.models.qwen3") is None,
                                reason="worker.models.qwen3 (the Qwen3 family) is not in this build yet")

LENGTHS = [3, 17, 64, 9]


def make_tiny_pplx(path):
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    model = Qwen3Model(config).eval()
    model.save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "bidirectional_pplx_qwen3"
    (path / "config.json").write_text(json.dumps(cfg))
    # Any tokenizer.json lets the server start; the test sends token ids.
    shutil.copy(os.path.join(default_model_path(), "tokenizer.json"), path / "tokenizer.json")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    return model


def hf_bidirectional_mean(model, ids: list[int]) -> np.ndarray:
    n = len(ids)
    # An all-zero additive 4D mask: every token sees every token (pplx-embed's attention).
    mask = torch.zeros(1, 1, n, n)
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), attention_mask=mask).last_hidden_state[0]
    return hidden.double().mean(dim=0).numpy()


def test_pplx_int8_is_round_127_tanh_of_the_bidirectional_mean_pool(tmp_path):
    path = tmp_path / "pplx"
    model = make_tiny_pplx(path)
    assert read_model_spec(str(path)).native_int8
    g = np.random.default_rng(3)
    seqs = [g.integers(1000, 30000, n).tolist() for n in LENGTHS]
    want = np.round(127 * np.tanh(np.stack([hf_bidirectional_mean(model, s) for s in seqs])))

    srv = ServerProcess("--model", str(path)).start(timeout=60)
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            reply = stub.Embed(pb.EmbedRequest(token_ids=[pb.TokenIds(ids=s) for s in seqs],
                                               encoding=pb.ENCODING_INT8), timeout=60)
    finally:
        assert srv.terminate() == 0
    q = np.frombuffer(reply.embeddings, np.int8).reshape(reply.rows, reply.dims).astype(np.float64)
    assert q.shape == want.shape
    assert np.abs(q - want).max() <= 1
    np.testing.assert_allclose(reply.scales, [1 / 127] * len(LENGTHS), rtol=1e-6)
