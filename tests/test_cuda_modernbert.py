"""ModernBERT on a real GPU: the windowed varlen kernels against the CPU's band mask, the GeGLU and
RoPE kernels against their torch references, and bf16 CUDA rows (flash with the sliding window,
the short-attention kernel, CUDA graphs) against sentence-transformers' fp32 CPU encode, on a tiny
checkpoint and on ModernBERT-base's widths with its window of 128. Skipped where no GPU is visible
(CI); run on the GPU machine."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (load/run_gpu.sh runs them on a GPU host)")]

from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.worker.models import attention, ops  # noqa: E402
from pollen.worker.models.attention import VarlenAttention  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402
from tests.test_model_modernbert import make_tiny_modernbert, pollen_ids, reference, texts  # noqa: E402

BASE = dict(hidden_size=768, num_attention_heads=12, intermediate_size=1152, num_hidden_layers=6)


def min_cos(a, b):
    a, b = torch.as_tensor(np.asarray(a), dtype=torch.float64), torch.as_tensor(np.asarray(b), dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b, dim=1).min().item()


def varlen_kinds():
    return ["torch_varlen"] + (["flash_attn"] if attention._flash_varlen is not None else [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_geglu_and_rope_kernels_equal_references(dtype):
    pytest.importorskip("triton")
    from pollen.worker.kernels.fused import triton_ops

    kernels = triton_ops("torch_varlen", EngineOptions())
    torch.manual_seed(0)
    gu = torch.randn(333, 2 * 1152, device="cuda", dtype=dtype)
    for form in ("none", "tanh"):
        torch.testing.assert_close(kernels.gelu_mul(gu, form), ops.gelu_mul(gu, form), rtol=1e-2, atol=1e-2)
    heads, d = 12, 64
    qkv = torch.randn(333, 3 * heads * d, device="cuda", dtype=dtype)
    cache = ops.rope_cache(160000.0, d, 8192, "cuda")
    pos = torch.randint(0, 8192, (333,), device="cuda", dtype=torch.int32)
    for a, b in zip(kernels.qk_norm_rope(qkv, None, None, cache, pos, heads, heads, 0.0),
                    ops.qk_norm_rope(qkv, None, None, cache, pos, heads, heads, 0.0)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("kind", varlen_kinds())
@pytest.mark.parametrize("window", [4, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_windowed_varlen_equals_the_band_mask(kind, window, causal):
    """flash's window_size=(w, w), or (w, 0) when causal (Mistral's window), is the band
    |i - j| <= w (and j <= i) of each sequence: sequences shorter than, just at and past w + 1
    tokens, and an empty one; float32 band-mask loop as the reference."""
    torch.manual_seed(1)
    lengths = [1, 5, window, window + 1, window + 2, 2 * window + 3, 300, 0, 7]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    tokens, heads, d = int(cu[-1]), 12, 64
    q, k, v = (torch.randn(tokens, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = VarlenAttention("sdpa_loop", window=window)(q.float(), k.float(), v.float(), cu, max(lengths), causal)
    got = VarlenAttention(kind, window=window)(q, k, v, cu, max(lengths), causal)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    unbounded = VarlenAttention("sdpa_loop")(q.float(), k.float(), v.float(), cu, max(lengths), causal)
    assert (unbounded - ref).abs().max() > 0.1  # the window changed the long sequences


def test_short_attention_takes_a_windowed_batch_only_where_the_window_changes_nothing():
    pytest.importorskip("triton")
    from pollen.worker.kernels.fused import triton_ops

    kernels = triton_ops(attention.backend(torch.device("cuda"), torch.bfloat16, EngineOptions()), EngineOptions())
    wide, narrow = VarlenAttention.of(kernels, 64, window=64), VarlenAttention.of(kernels, 64, window=4)
    assert wide.short is not None and (wide.short_max, narrow.short_max) == (64, 5)
    torch.manual_seed(2)
    for length in (5, 6, 40):
        cu = torch.tensor([0, 3, 3 + length], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(3 + length, 12, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = VarlenAttention("sdpa_loop", window=4)(q.float(), k.float(), v.float(), cu, length, False)
        torch.testing.assert_close(narrow(q, k, v, cu, length, False).float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", ["tiny", "base"])
def test_bf16_cuda_rows_match_sentence_transformers_fp32(tmp_path, shape):
    """Mixed lengths past the window in one batch, and a batch of short queries (the short-attention
    kernel): fp32 CUDA to 0.99999, bf16 eager and through CUDA graphs to 0.999, the graph's rows
    the same on a second run."""
    from pollen.worker.cuda_engine import CudaEngine

    if shape == "tiny":
        path = make_tiny_modernbert(tmp_path / "m", "cls", local_attention=16, every=2, biases=True, gain=1.0)
        docs = texts()
    else:
        path = make_tiny_modernbert(tmp_path / "m", "mean", local_attention=128, every=3, max_tokens=1024, shape=BASE,
                                    gain=1.0)
        docs = texts(lengths=(1, 4, 9, 30, 60, 100, 150, 250, 400, 600))
    queries = texts(8, seed=7, lengths=(1, 2, 3, 4, 5, 6, 8, 10))
    batches = {"docs": (pollen_ids(path, docs), reference(path, docs)),
               "queries": (pollen_ids(path, queries), reference(path, queries))}
    assert max(len(s) for s in batches["queries"][0]) <= 16 < max(len(s) for s in batches["docs"][0])
    fp32 = CudaEngine(load_model(path, "cuda", torch.float32), "cuda", max_batch_tokens=8192)
    for seqs, ref in batches.values():
        assert min_cos(fp32.submit(pack(seqs)).result(), ref) >= 0.99999
    for graphs in (False, True):
        engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=8192,
                            cuda_graphs=graphs)
        engine.warm_up()
        for name, (seqs, ref) in batches.items():
            first, second = engine.submit(pack(seqs)), engine.submit(pack(seqs))
            a, b = first.result().copy(), second.result().copy()
            assert min_cos(a, ref) >= 0.999 and min_cos(b, ref) >= 0.999, (name, graphs)
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # the same batch twice: the same rows (to float32 rounding)
