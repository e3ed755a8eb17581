"""Engines write pooled rows into the caller's buffer and normalize the flagged ones on their
device. On the CPU: the eager engine, and the CUDA engine's own input layout and forward (the
flags travel with the int32 inputs; bucket padding included), run on a CPU model.
The GPU half (registered ring memory, graphs) is tests/test_cuda_ring.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pollen.v1 import embedder_pb2 as pb
from pollen.worker.eager_engine import EagerEngine
from pollen.worker.models.loader import load_model
from pollen.worker.models.pooling import normalize_rows
from pollen.worker.packed import RowSpans, pack
from pollen.worker.postprocess import finish


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.test_model_bert import make_tiny

    path = tmp_path_factory.mktemp("tiny") / "bert"
    make_tiny(path)
    return load_model(str(path))


def seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 1000, n, dtype=np.int32) for n in lengths]


def finished(rows: np.ndarray, normalize: bool) -> np.ndarray:
    """What postprocess.finish makes of float32 rows: the CPU reference for device normalization."""
    out = bytearray(rows.nbytes)
    finish(rows, 0, normalize, pb.ENCODING_FLOAT32, memoryview(out))
    return np.frombuffer(bytes(out), np.float32).reshape(rows.shape)


def test_eager_engine_writes_and_normalizes_into_out(model):
    engine = EagerEngine(model)
    batch = pack(seqs([3, 9, 1, 20, 7]))
    plain = engine.submit(batch).result()
    flags = np.array([1, 0, 1, 1, 0], np.int32)
    out = np.full((batch.rows, 32), np.nan, np.float32)
    assert engine.submit(batch, out=out, normalize=flags).result() is out
    np.testing.assert_allclose(out[flags == 1], finished(plain[flags == 1], True), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out[flags == 0], plain[flags == 0])


def test_normalize_rows_matches_postprocess_and_keeps_zero_rows_zero():
    rows = np.random.default_rng(1).standard_normal((6, 40)).astype(np.float32) * 50
    rows[2] = 0
    rows[4] = 1e-30  # below the 1e-12 floor: divided by the floor, as postprocess does
    got = normalize_rows(torch.from_numpy(rows), torch.ones(6, dtype=torch.int32)).numpy()
    np.testing.assert_allclose(got, finished(rows, True), rtol=1e-6, atol=1e-30)
    assert not got[2].any()


@pytest.mark.parametrize("padded", [False, True])
def test_cuda_engine_layout_and_forward_on_the_cpu(model, padded):
    """CudaEngine.fill packs ids, spans and normalize flags into its compact int32 layout (padded
    to a graph bucket or not); its forward over that layout, here on a CPU model, equals the
    eager engine with the same flags."""
    from pollen.worker.cuda_engine import CudaEngine, token_buckets

    engine = CudaEngine.__new__(CudaEngine)  # no device: only the layout and the forward
    engine.model, engine.pooling, engine.max_positions = model, model.spec.pooling, model.spec.max_tokens
    engine.graphs_on, engine.buckets = True, token_buckets(256)
    docs = seqs([12, 5, 30], seed=2)
    batch = pack(docs, RowSpans.of([[(0, 4), (4, 12)], [(0, 5)], [(1, 9), (9, 30)]]))
    flags = np.array([1, 0, 1, 0, 1], np.int32)
    shape = engine.bucket(batch) if padded else None
    host = torch.zeros(8 * 256 + 16, dtype=torch.int32)
    engine.fill(host, batch, shape, flags)
    tokens, n_seqs, _, rows = shape if padded else (batch.tokens, len(batch.cu_seqlens) - 1, 0, batch.rows)
    if padded:  # a padding sequence and padding rows
        assert tokens > batch.tokens and n_seqs > len(batch.cu_seqlens) - 1 and rows > batch.rows
    inputs, _ = CudaEngine.views(host, tokens, n_seqs, rows)
    assert inputs[-1].tolist()[:batch.rows] == flags.tolist() and not inputs[-1][batch.rows:].any()
    with torch.inference_mode():
        got = engine.forward(inputs, shape[2] if padded else batch.max_seqlen)[:batch.rows].numpy()
    want = EagerEngine(model).submit(batch, normalize=flags).result()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
