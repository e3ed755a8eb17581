"""Contextual chunks and CHUNK_MEAN through the server, against HF transformers on the same
weights (all-MiniLM-L6-v2): the whole document in one forward pooled per chunk span, and the
documented windows embedded one by one and averaged with token weights."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from pollen.common.model_spec import default_model_path
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, vectors

CHUNKS = ["Marie Curie was born in Warsaw in 1867.",
          "She moved to Paris to study physics and mathematics.",
          "There she discovered polonium and radium with Pierre.",
          "Her notebooks are still radioactive."]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModel, AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def hidden(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()


def chunk_reference(hf, chunks: list[str], prompt: str = "", mode: str = "mean") -> tuple[np.ndarray, int]:
    """[CLS] prompt chunk1 ... chunkN [SEP] in one HF forward; each chunk's tokens pooled: their
    mean, or the chunk's first token (cls models) or last token (last-token models)."""
    tok, model = hf
    head = tok(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    pieces = [tok(c, add_special_tokens=False)["input_ids"] for c in chunks]
    ids = [tok.cls_token_id] + head + [i for p in pieces for i in p] + [tok.sep_token_id]
    states = hidden(model, ids)
    want, at = [], 1 + len(head)
    for p in pieces:
        span = states[at:at + len(p)]
        want.append({"mean": span.mean(axis=0), "cls": span[0], "last": span[-1]}[mode])
        at += len(p)
    return np.stack(want), len(ids)


def test_contextual_chunks_pool_each_span_of_one_forward(stub, hf):
    want, n_ids = chunk_reference(hf, CHUNKS)

    reply = stub.Embed(pb.EmbedRequest(chunks=CHUNKS), timeout=60)
    got = vectors(reply)
    assert got.shape == (len(CHUNKS), 384)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert reply.usage.prompt_tokens == n_ids
    # Context matters: a chunk embedded alone differs from the same chunk read in its document.
    alone = vectors(stub.Embed(pb.EmbedRequest(chunks=CHUNKS[1:2]), timeout=60))
    assert np.abs(alone[0] - got[1]).max() > 1e-3

    # Encodings and Matryoshka apply per chunk row as for texts.
    cut = vectors(stub.Embed(pb.EmbedRequest(chunks=CHUNKS, dimensions=64, normalize=True), timeout=60))
    np.testing.assert_allclose(cut, want[:, :64] / np.linalg.norm(want[:, :64], axis=1, keepdims=True), atol=2e-5)


@pytest.mark.parametrize("mode", ["cls", "last"])
def test_chunks_of_cls_and_last_token_models_pool_the_chunks_first_and_last_token(hf, mode):
    want, _ = chunk_reference(hf, CHUNKS, mode=mode)
    srv = ServerProcess("--pooling", mode, "--log-level", "WARNING").start()
    try:
        with grpc.insecure_channel(srv.listen) as channel:
            reply = pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(chunks=CHUNKS), timeout=60)
    finally:
        assert srv.terminate() == 0
    np.testing.assert_allclose(vectors(reply), want, atol=2e-5)


def test_a_prompt_precedes_the_chunks_and_pools_into_none(stub, hf):
    want, n_ids = chunk_reference(hf, CHUNKS, prompt="passage: ")
    reply = stub.Embed(pb.EmbedRequest(chunks=CHUNKS, prompt="passage: "), timeout=60)
    np.testing.assert_allclose(vectors(reply), want, atol=2e-5)
    assert reply.usage.prompt_tokens == n_ids


def test_chunk_mean_is_the_token_weighted_mean_of_windows(stub, hf):
    tok, model = hf
    text = " ".join(f"sentence {i} talks about topic {i % 7} and the weather." for i in range(60))
    content = tok(text, add_special_tokens=False)["input_ids"]
    room = 256 - 2
    stride = room - room // 8
    assert len(content) > 2 * room  # at least three windows
    starts = [0]
    while starts[-1] + room < len(content):
        starts.append(starts[-1] + stride)
    windows = [[tok.cls_token_id] + content[s:s + room] + [tok.sep_token_id] for s in starts]
    means = np.stack([hidden(model, w).mean(axis=0) for w in windows])
    weights = np.array([len(w) for w in windows], dtype=np.float64)
    want = (means * weights[:, None]).sum(axis=0) / weights.sum()

    reply = stub.Embed(pb.EmbedRequest(texts=[text, "a short text"], long_input=pb.LONG_INPUT_CHUNK_MEAN), timeout=60)
    got = vectors(reply)
    np.testing.assert_allclose(got[0], want, atol=2e-5)
    short = vectors(stub.Embed(pb.EmbedRequest(texts=["a short text"]), timeout=60))
    np.testing.assert_allclose(got[1], short[0], atol=1e-6)  # a text that fits is one window
    assert reply.usage.prompt_tokens == int(weights.sum()) + len(tok("a short text")["input_ids"])

    normalized = vectors(stub.Embed(pb.EmbedRequest(texts=[text], long_input=pb.LONG_INPUT_CHUNK_MEAN,
                                                    normalize=True), timeout=60))
    np.testing.assert_allclose(normalized[0], want / np.linalg.norm(want), atol=2e-5)
