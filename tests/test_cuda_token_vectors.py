"""Per-token vectors (server/tasks/token_vectors.py: every token a one-token row) on a real GPU: the
CUDA engine's rows of a BERT encoder and a Qwen3 decoder over the token row plan, in float32
eager and in bfloat16 through the captured graphs, against HF transformers' last_hidden_state of
each text (float32, CPU). Skipped where no GPU is visible (CI); run on the GPU machine."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (load/run_gpu.sh runs them on a GPU host)")]

from pollen.worker.engine import make_engine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import RowSpans, pack  # noqa: E402
from tests.st_models import copy_bert_tokenizer, randomize, save_bpe_tokenizer, texts, token_ids  # noqa: E402


def make_folder(path, kind: str) -> str:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "bert":
        model = tf.BertModel(tf.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, max_position_embeddings=512))
    else:
        model = tf.Qwen3Model(tf.Qwen3Config(vocab_size=400, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                             max_position_embeddings=2048))
    randomize(model)
    model.eval().save_pretrained(str(path))
    if kind == "bert":
        copy_bert_tokenizer(path)
    else:
        save_bpe_tokenizer(path)
    return str(path)


@torch.no_grad()
def hf_hidden(path: str, seqs: list[np.ndarray]) -> list[np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    return [model(input_ids=torch.tensor([s.tolist()])).last_hidden_state[0].numpy() for s in seqs]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("kind", ["bert", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-eager", "bf16-graphs"])
def test_token_rows_on_cuda_equal_hf_last_hidden_state(tmp_path, kind, dtype):
    path = make_folder(tmp_path / kind, kind)
    seqs = token_ids(path, texts([1, 4, 9, 30, 80]))
    want = np.concatenate(hf_hidden(path, seqs))
    spans = RowSpans.of([[(i, i + 1) for i in range(len(s))] for s in seqs])
    engine = make_engine(load_model(path, device="cuda", dtype=dtype), "cuda", max_batch_tokens=1024)
    engine.warm_up()
    for _ in range(2):  # the second time through the graph captured for this size
        got = np.asarray(engine.submit(pack(seqs, spans)).result())
        assert got.shape == want.shape
        assert cosine_rows(got, want).min() >= (0.99999 if dtype == torch.float32 else 0.99)
    if dtype == torch.bfloat16:
        assert engine.graphs
    engine.close()
