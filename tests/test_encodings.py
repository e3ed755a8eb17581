"""Encodings and Matryoshka dimensions equal the float32 answer transformed in numpy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pollen.v1 import embedder_pb2 as pb
from tests.conftest import vectors

TEXTS = ["positive and negative values", "東京 🙂", "a third, longer text about encodings and bits"]


def embed(stub, **options) -> pb.EmbedResponse:
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS, **options), timeout=60)
    assert not reply.HasField("error")
    return reply


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dims", [0, 32, 100])
def test_encodings_equal_numpy_transforms(stub, normalize, dims):
    full = vectors(embed(stub))
    want = full[:, :dims] if dims else full
    if normalize:
        want = want / np.linalg.norm(want, axis=1, keepdims=True)
    got32 = vectors(embed(stub, dimensions=dims, normalize=normalize))
    np.testing.assert_allclose(got32, want, rtol=1e-6, atol=1e-7)

    f16 = embed(stub, dimensions=dims, normalize=normalize, encoding=pb.ENCODING_FLOAT16)
    assert (f16.encoding, f16.rows, f16.dims) == (pb.ENCODING_FLOAT16, 3, want.shape[1])
    np.testing.assert_array_equal(np.frombuffer(f16.embeddings, "<f2").reshape(want.shape), want.astype(np.float16))

    bf16 = embed(stub, dimensions=dims, normalize=normalize, encoding=pb.ENCODING_BFLOAT16)
    bits = np.frombuffer(bf16.embeddings, "<u2").reshape(want.shape)
    ref = torch.tensor(want).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, ref)

    i8 = embed(stub, dimensions=dims, normalize=normalize, encoding=pb.ENCODING_INT8)
    q = np.frombuffer(i8.embeddings, np.int8).reshape(want.shape).astype(np.float64)
    scale = np.abs(want).max(axis=1) / 127
    np.testing.assert_allclose(i8.scales, scale, rtol=1e-6)
    assert np.abs(q - np.round(want / scale[:, None])).max() <= 1
    assert np.abs(q).max() == 127  # the largest value takes the whole range
    assert np.abs(q * np.asarray(i8.scales)[:, None] - want).max() <= scale.max()

    ub = embed(stub, dimensions=dims, normalize=normalize, encoding=pb.ENCODING_UBINARY)
    packed = np.frombuffer(ub.embeddings, np.uint8).reshape(3, (want.shape[1] + 7) // 8)
    np.testing.assert_array_equal(np.unpackbits(packed, axis=1, bitorder="little")[:, :want.shape[1]], want > 0)
