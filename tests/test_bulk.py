"""pollen.bulk.embedder without Ray: the engine in this process answers what the server answers
(truncation, Matryoshka cuts, batches split by the token budget), and bad texts are named."""
from __future__ import annotations

import numpy as np
import pytest

from pollen.bulk.embedder import BulkEmbedder
from pollen.v1 import embedder_pb2 as pb
from tests.conftest import cosine_rows, vectors
from tests.texts import varied_texts


@pytest.fixture(scope="module")
def embedder():
    # A small token budget: the texts below take several engine batches.
    return BulkEmbedder(max_batch_tokens=300)


def served(stub, texts, **options) -> np.ndarray:
    """The server's vectors, in requests of at most 64 texts (the test server's limit)."""
    return np.concatenate([vectors(stub.Embed(pb.EmbedRequest(texts=texts[i:i + 64], normalize=True,
                                                              truncate=pb.TRUNCATE_END, **options), timeout=60))
                           for i in range(0, len(texts), 64)])


def test_vectors_are_the_servers(embedder, stub):
    texts = varied_texts(90, seed=3) + ["a long text " * 400]  # the last is cut to its start (truncate end)
    assert len(list(embedder.batches(texts))) > 3
    got = embedder.embed(texts)
    assert got.shape == (len(texts), 384) and got.dtype == np.float32
    assert cosine_rows(got, served(stub, texts)).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


def test_a_matryoshka_cut_is_the_servers(stub):
    texts = varied_texts(20, seed=4)
    got = BulkEmbedder(dimensions=64).embed(texts)
    assert got.shape == (20, 64)
    assert cosine_rows(got, served(stub, texts, dimensions=64)).min() >= 0.9999


def test_bad_texts_and_options_are_named(embedder):
    with pytest.raises(ValueError, match=r"text 70 \(of 71\) is empty"):
        embedder.embed(["fine"] * 70 + [""])
    with pytest.raises(ValueError, match=r"text 1 \(of 2\) is not a string but NoneType"):
        embedder.embed(["fine", None])
    with pytest.raises(ValueError, match="dimensions 1000 is not offered"):
        BulkEmbedder(dimensions=1000)
    with pytest.raises(ValueError, match="truncate must be one of"):
        BulkEmbedder(truncate="middle")
