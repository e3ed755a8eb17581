"""`pollen serve` starts with every default on checkpoints shaped like the real Qwen3-Embedding
(8,192 tokens) and pplx-embed (32,768 tokens); and a request larger than one request record
travels as several, answered exactly as if it had not been split."""
from __future__ import annotations

import json
import os
import shutil

import grpc
import numpy as np
import pytest

from pollen.common.model_spec import default_model_path
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, vectors


def make_tiny_long_qwen3(path, model_type: str, limit: int) -> None:
    """A tiny random Qwen3 whose sentence-transformers max_seq_length is `limit` (the real models'
    limits), with all-MiniLM-L6-v2's tokenizer (its ids fit the vocabulary)."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=limit)
    Qwen3Model(config).eval().save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(os.path.join(default_model_path(), "tokenizer.json"), path / "tokenizer.json")
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": limit}))


@pytest.mark.parametrize("model_type, limit", [("qwen3", 8192), ("bidirectional_pplx_qwen3", 32768)])
def test_serve_starts_with_every_default(tmp_path, model_type, limit):
    make_tiny_long_qwen3(tmp_path, model_type, limit)
    server = ServerProcess("--model", str(tmp_path)).start(timeout=60)
    try:
        with grpc.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            info = stub.Info(pb.InfoRequest())
            assert info.max_tokens == limit and info.max_texts_per_request == 512
            reply = stub.Embed(pb.EmbedRequest(texts=["a query", "another one"], normalize=True), timeout=60)
            assert vectors(reply).shape == (2, 64)
    finally:
        assert server.terminate() == 0


def test_a_request_over_one_record_is_split_and_answered_whole(stub):
    """64 KiB request rings carry at most 32 KiB a record: these requests travel as several."""
    rng = np.random.default_rng(3)
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "pollen"], size=int(n)))
             for n in rng.integers(100, 300, size=48)]
    long_texts = [" ".join(["word"] * 6000), "short", " ".join(["other"] * 1500)]
    requests = [pb.EmbedRequest(texts=texts, normalize=True, truncate=pb.TRUNCATE_END),
                pb.EmbedRequest(texts=texts, encoding=pb.ENCODING_INT8, dimensions=64, truncate=pb.TRUNCATE_END),
                pb.EmbedRequest(texts=long_texts, long_input=pb.LONG_INPUT_CHUNK_MEAN)]
    small = ServerProcess("--request-ring-bytes", str(64 << 10), "--max-texts-per-request", "64").start()
    try:
        with grpc.insecure_channel(small.listen) as channel:
            split = [pb_grpc.EmbedderStub(channel).Embed(r, timeout=120) for r in requests]
    finally:
        small.terminate()
    for request, got in zip(requests, split):
        want = stub.Embed(request, timeout=120)  # the session server: big rings, one record
        assert (got.rows, got.dims, got.encoding) == (want.rows, want.dims, want.encoding)
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        if request.encoding == pb.ENCODING_INT8:
            assert got.embeddings == want.embeddings
            np.testing.assert_allclose(got.scales, want.scales, rtol=1e-6)
        else:
            np.testing.assert_allclose(np.frombuffer(got.embeddings, "<f4"), np.frombuffer(want.embeddings, "<f4"),
                                       atol=2e-6)
