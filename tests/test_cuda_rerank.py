"""Rerankers on a real GPU: bf16 scores against fp32 on 1,000 STS-B sentence pairs (sentence1 as
the query, sentence2 as the document), in the frontend's pair form (server/rerank.py), through the
CUDA engine with its graphs, for each shape of load/rerank_models.py: Spearman >= 0.999. Needs
the STS-B test CSV (POLLEN_STSB), a BERT tokenizer directory (POLLEN_BERT_TOKENIZER_DIR) and the
Qwen3 tokenizer.json (POLLEN_QWEN3_TOKENIZER); skipped cleanly without a GPU or those."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

NEEDS = ("POLLEN_STSB", "POLLEN_BERT_TOKENIZER_DIR", "POLLEN_QWEN3_TOKENIZER")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)"),
              pytest.mark.skipif(not all(os.environ.get(n) for n in NEEDS), reason=f"needs {', '.join(NEEDS)}")]

from load.bench_engine import ours_rows  # noqa: E402
from load.rerank_models import RERANK_SHAPES, make_reranker, stsb_pairs  # noqa: E402
from pollen.common.model_spec import read_model_spec  # noqa: E402
from pollen.server.rerank import PairBuilder  # noqa: E402
from pollen.server.tokenizer import TextTokenizer  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.worker.cuda_engine import CudaEngine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402

PAIRS = 1000
ROOT = "/tmp/pollen-rerank-ckpt"


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ranks = [np.argsort(np.argsort(x, kind="stable")).astype(np.float64) for x in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def pair_sequences(path: str) -> list[np.ndarray]:
    spec = read_model_spec(path)
    builder = PairBuilder(spec, TextTokenizer(path, spec.max_tokens))
    return [builder.pairs(q, [d], "", min(spec.max_tokens, 512), pb.TRUNCATE_END)[0]
            for q, d in stsb_pairs(os.environ["POLLEN_STSB"], PAIRS)]


def scores(path: str, seqs: list[np.ndarray], dtype: torch.dtype) -> np.ndarray:
    engine = CudaEngine(load_model(path, device="cuda", dtype=dtype), "cuda", max_batch_tokens=16384,
                        graph_max_tokens=8192)
    engine.warm_up()
    rows = ours_rows(engine, seqs)
    del engine
    torch.cuda.empty_cache()
    return rows[:, 0]


@pytest.mark.parametrize("shape", list(RERANK_SHAPES))
def test_bf16_scores_rank_as_fp32(shape):
    path = make_reranker(shape, ROOT, os.environ["POLLEN_BERT_TOKENIZER_DIR"], os.environ["POLLEN_QWEN3_TOKENIZER"])
    seqs = pair_sequences(path)
    full, half = scores(path, seqs, torch.float32), scores(path, seqs, torch.bfloat16)
    rho = spearman(full, half)
    print(f"{shape}: Spearman {rho:.5f} over {len(seqs)} pairs; fp32 scores spread {full.std():.4f}, "
          f"bf16 - fp32 max {np.abs(full - half).max():.4f}")
    assert np.isfinite(full).all() and full.std() > 0
    assert rho >= 0.999
