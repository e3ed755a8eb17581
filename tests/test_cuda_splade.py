"""SPLADE on a real GPU: the CUDA engine's sparse rows (the MLM head over every token, the max over
each sequence by one scatter in worker/models/pooling.py, the SparseHead's largest weights) against
the transformers recipe, in float32 eager and in bfloat16 through the captured graphs, with
sequences of mixed lengths in one batch and the same batch twice. Skipped where no GPU is visible
(CI); run on the GPU machine."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (load/run_gpu.sh runs them on a GPU host)")]

from pollen.common.model_spec import SPARSE_TERMS  # noqa: E402
from pollen.server.tasks.sparse_vectors import finish  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402
from tests.st_models import texts, token_ids  # noqa: E402
from tests.test_splade import make_distilbert_head, make_splade, reference  # noqa: E402


def sparse_rows(rows) -> list[dict[int, float]]:
    ids, weights, counts = finish(np.asarray(rows), SPARSE_TERMS)
    bounds = np.cumsum([0, *counts])
    return [dict(zip(ids[a:b].tolist(), weights[a:b].tolist())) for a, b in zip(bounds[:-1], bounds[1:])]


# DistilBERT twice more: its MLM head with every part's mark on the weights, tied and untied
# (tests/test_splade.py make_distilbert_head).
CHECKPOINTS = {"bert": lambda path: make_splade(path, "bert"), "distilbert": lambda path: make_splade(path, "distilbert"),
               "distilbert-head": lambda path: make_distilbert_head(path, tied=True),
               "distilbert-untied": lambda path: make_distilbert_head(path, tied=False)}


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_cuda_sparse_rows_equal_the_transformers_recipe(tmp_path, kind):
    from pollen.worker.cuda_engine import CudaEngine

    path = CHECKPOINTS[kind](tmp_path / kind)
    docs = texts([1, 3, 9, 30, 45, 60])  # at most 109 tokens: the tiny models have 128 positions
    want = reference(path, docs)
    seqs = token_ids(path, docs)
    fp32 = CudaEngine(load_model(path, "cuda", torch.float32), "cuda", max_batch_tokens=4096, cuda_graphs=False)
    for got, ref in zip(sparse_rows(fp32.submit(pack(seqs)).result()), want):
        assert got.keys() == ref.keys()
        np.testing.assert_allclose([got[i] for i in ref], list(ref.values()), rtol=0, atol=1e-4)
    del fp32
    bf16 = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=4096, cuda_graphs=True)
    bf16.warm_up()
    for _ in range(2):  # the second time through the graph captured for this size
        for got, ref in zip(sparse_rows(bf16.submit(pack(seqs)).result()), want):
            # bf16 moves weights near zero across it: the terms that matter, the largest, agree.
            top = sorted(ref, key=ref.get, reverse=True)[:10]
            assert set(top) <= set(got), (sorted(got), top)
            np.testing.assert_allclose([got[i] for i in top], [ref[i] for i in top], rtol=0.05, atol=0.02)
