"""On a real GPU: the fused RoPE kernels without QK-norm (Qwen2, Mistral, Llama) against their
torch references, and the CUDA engine, eager and in CUDA graphs, against the CPU engine (itself
checked against sentence-transformers in test_model_decoders.py and test_dense_modules.py) for
those decoders and for a BERT checkpoint with Dense modules, which run inside the graph. Skipped
cleanly where no GPU is visible."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (load/run_gpu.sh runs them on a GPU host)")]

from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.worker.eager_engine import EagerEngine  # noqa: E402
from pollen.worker.models import ops  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402

# Queries (the short and skinny kernels) and documents past the short kernels' 64 tokens.
LENGTHS = ([5, 17, 3, 64], [1, 9, 2, 40, 64, 13, 3, 150, 90])


def cos(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b, dim=1).min().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_kernels_without_qk_norm_equal_references(dtype):
    pytest.importorskip("triton")
    from pollen.worker.kernels.fused import triton_ops
    from pollen.worker.kernels.short_attention import short_qk_rope_attention
    from pollen.worker.models.attention import _torch_varlen, _torch_varlen_options

    kernels = triton_ops("torch_varlen", EngineOptions())
    torch.manual_seed(0)
    t, heads, kv, d = 333, 16, 8, 128
    qkv = torch.randn(t, (heads + 2 * kv) * d, device="cuda", dtype=dtype)
    cache = ops.rope_cache(1e6, d, 4096, "cuda", scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
    pos = torch.randint(0, 4096, (t,), device="cuda", dtype=torch.int32)
    for a, b in zip(kernels.qk_norm_rope(qkv, None, None, cache, pos, heads, kv, 1e-6),
                    ops.qk_norm_rope(qkv, None, None, cache, pos, heads, kv, 1e-6)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=2e-2)

    cu = torch.tensor([0, 5, 5, 21, 22, 86], dtype=torch.int32, device="cuda")
    qkv, pos = qkv[:86], torch.cat([torch.arange(n, device="cuda") for n in (5, 0, 16, 1, 64)]).int()
    for causal in (False, True):
        q, k, v = ops.qk_norm_rope(qkv, None, None, cache, pos, heads, kv, 1e-6)
        ref = _torch_varlen(q, k, v, cu, cu, 64, 64, **_torch_varlen_options(causal, True))
        got = short_qk_rope_attention(qkv, None, None, cache, pos, heads, kv, 1e-6, cu, 64, causal)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def dense_checkpoint(tmp_path) -> str:
    import transformers as tf

    from tests.st_models import BERT_VOCAB, copy_bert_tokenizer, randomize, save_st
    from tests.test_dense_modules import dense

    torch.manual_seed(0)
    model = tf.BertModel(tf.BertConfig(vocab_size=BERT_VOCAB, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=128, max_position_embeddings=256))
    randomize(model)
    model.eval().save_pretrained(str(tmp_path / "hf"))
    copy_bert_tokenizer(tmp_path / "hf")
    save_st(tmp_path / "st", tmp_path / "hf", "mean", dense=[dense(64, 96, "Tanh"), dense(96, 48, bias=False, seed=2)])
    return str(tmp_path / "st")


def decoder_checkpoint(tmp_path, model_type: str) -> str:
    from tests.test_model_decoders import make_decoder

    # Heads of 64: the short-attention and query kernels take them. Mistral's window of 48 is
    # shorter than the longer sequences (flash's causal window_size=(47, 0)).
    extra = {"qwen2": {}, "mistral": {"sliding_window": 48}, "llama": {"attention_bias": True}}[model_type]
    make_decoder(tmp_path / "m", model_type, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=512, max_position_embeddings=512, **extra)
    return str(tmp_path / "m")


@pytest.mark.parametrize("kind", ["dense", "qwen2", "mistral", "llama"])
def test_cuda_engine_matches_the_cpu_engine(tmp_path, kind):
    from pollen.worker.cuda_engine import CudaEngine

    path = dense_checkpoint(tmp_path) if kind == "dense" else decoder_checkpoint(tmp_path, kind)
    cpu = EagerEngine(load_model(path))
    vocab = cpu.model.spec.vocab_size
    fp32 = CudaEngine(load_model(path, "cuda", torch.float32), "cuda", max_batch_tokens=1024)
    for graphs in (False, True):
        engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=1024,
                            cuda_graphs=graphs)
        engine.warm_up()
        for lengths in LENGTHS:
            rng = np.random.default_rng(len(lengths))
            batch = pack([rng.integers(0, vocab, n, dtype=np.int32) for n in lengths])
            flags = np.arange(batch.rows, dtype=np.int32) % 2  # every other row normalized on the device
            ref = cpu.submit(batch, normalize=flags).result()
            assert cos(fp32.submit(batch, normalize=flags).result(), ref) >= 0.99999
            got = engine.submit(batch, normalize=flags).result()
            assert got.shape == ref.shape == (batch.rows, cpu.model.spec.output_dims)
            assert cos(got, ref) >= 0.999
            np.testing.assert_allclose(np.linalg.norm(got[1::2], axis=1), 1.0, atol=1e-3)
        if graphs:
            assert engine.graphs  # the batches replayed captured graphs
