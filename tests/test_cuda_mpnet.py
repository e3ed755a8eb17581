"""MPNet on a real GPU: the relative-bias attention kernel against a dense reference built from HF's
bucket function, eagerly and replayed in a CUDA graph; and the CUDA engine (bf16 with and without
graphs, float32, Triton off) against sentence-transformers' fp32 CPU encode of the same texts.
Skipped cleanly where no GPU is visible (CI); run on the GPU machine."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (load/run_gpu.sh runs them on a GPU host)")]

from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.server.pipeline.tokenizer import TextTokenizer  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.models.relative_position import bias_table  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402
from tests.test_model_mpnet import TEXTS, make_tiny_mpnet, st_encode  # noqa: E402

LENGTHS = [1, 0, 64, 65, 130, 300, 384, 17, 2, 513]  # an empty one, block edges, past 128 and 384


def dense_reference(q, k, v, cu, weight):
    """float32 softmax(q k^T / sqrt(D) + bias) v per sequence, the bias from HF's own bucket function."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    q, k, v = q.float(), k.float(), v.float()
    out = torch.zeros_like(q)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        at = torch.arange(end - start)
        # Buckets on the CPU, as the reference (HF on the CPU) computes them: a log on the GPU may
        # round a bucket boundary the other way.
        buckets = MPNetEncoder.relative_position_bucket(at[None, :] - at[:, None]).to(q.device)
        bias = weight.float()[buckets].permute(2, 0, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) / q.shape[2] ** 0.5 + bias
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[start:end])
    return out


def packed(lengths, heads, d, dtype, seed=0):
    """q, k, v as the strided views of one fused projection (as BertLayer splits it), cu_seqlens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, d, device="cuda", generator=g).to(dtype)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(lengths, device="cuda").cumsum(0)
    return (*qkv.unbind(1), cu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,d", [(12, 64), (4, 16), (6, 24)])
def test_kernel_equals_dense_reference(dtype, heads, d):
    pytest.importorskip("triton")
    from pollen.worker.kernels.relative_attention import relative_attention

    q, k, v, cu = packed(LENGTHS, heads, d, dtype)
    weight = 1.5 * torch.randn(32, heads, device="cuda")
    got = relative_attention(q, k, v, cu, max(LENGTHS), bias_table(weight))
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), dense_reference(q, k, v, cu, weight), rtol=2e-2, atol=2e-2)


def test_kernel_replays_in_a_graph():
    """Captured once, replayed on new values and new sequence bounds of the same shapes: no host
    sync in the launch (a capture would refuse one) and nothing read at capture time."""
    pytest.importorskip("triton")
    from pollen.worker.kernels.relative_attention import relative_attention

    q, k, v, cu = packed(LENGTHS, 12, 64, torch.bfloat16)
    table = bias_table(torch.randn(32, 12, device="cuda"))
    relative_attention(q, k, v, cu, 513, table)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = relative_attention(q, k, v, cu, 513, table)
    others = [513, 300, 0, 200, 1, 2, 384, 40, 30, 6]  # the same total and count
    assert sum(others) == sum(LENGTHS) and len(others) == len(LENGTHS)
    q2, k2, v2, cu2 = packed(others, 12, 64, torch.bfloat16, seed=1)
    for x, y in ((q, q2), (k, k2), (v, v2), (cu, cu2)):
        x.copy_(y)
    graph.replay()
    torch.testing.assert_close(out, relative_attention(q2, k2, v2, cu2, 513, table), rtol=0, atol=0)


def served(path, model, texts):
    """One packed batch of the texts as the frontend tokenizes them."""
    return pack(TextTokenizer(str(path), model.spec.max_tokens).encode(texts, pb.TRUNCATE_END))


def cosines(rows, ref):
    a, b = np.asarray(rows, np.float64), np.asarray(ref, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("hidden,heads", [(64, 4), (768, 12)])  # the second: all-mpnet-base-v2's heads
def test_cuda_engine_matches_sentence_transformers(tmp_path, hidden, heads):
    """bf16 against fp32 sentence-transformers on the CPU, with graphs (the Triton kernel) and
    eagerly; float32 on CUDA (the SDPA loop) exactly; and with Triton off, the loop in bf16, which
    reads the host and so runs without graphs. A batch of many short texts makes the graph's
    padding sequence longer than the bucket's longest sequence (its rows are discarded)."""
    from pollen.worker.cuda_engine import CudaEngine

    path = tmp_path / "m"
    make_tiny_mpnet(path, hidden=hidden, heads=heads)
    short = [f"query number {i}: {TEXTS[i % 4]}" for i in range(150)]
    ref, ref_short = st_encode(path, TEXTS), st_encode(path, short)

    fp32 = load_model(str(path), "cuda", torch.float32)
    assert fp32.host_syncs
    assert cosines(CudaEngine(fp32, "cuda", max_batch_tokens=4096).submit(served(path, fp32, TEXTS)).result(),
                   ref).min() >= 0.99999

    for graphs in (False, True):
        model = load_model(str(path), "cuda", torch.bfloat16)
        assert model.attention.kernel is not None and not model.host_syncs
        engine = CudaEngine(model, "cuda", max_batch_tokens=4096, cuda_graphs=graphs)
        assert engine.graphs_on == graphs
        engine.warm_up()
        for texts, want in ((TEXTS, ref), (short, ref_short)):
            batch = served(path, model, texts)
            first, second = engine.submit(batch), engine.submit(batch)  # the second overlaps the first
            a, b = first.result().copy(), second.result().copy()
            assert cosines(a, want).min() >= 0.999, (graphs, len(texts))
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # the same batch twice: the same rows (to float32 rounding)
        if graphs:
            assert len(engine.graphs) == 2
            tokens, _, longest, _ = engine.bucket(batch)  # the short texts' bucket
            assert tokens - batch.tokens > longest  # the padding sequence outgrows max_seqlen

    plain = load_model(str(path), "cuda", torch.bfloat16, options=EngineOptions(triton=False))
    assert plain.attention.kernel is None and plain.host_syncs
    engine = CudaEngine(plain, "cuda", max_batch_tokens=4096)
    assert not engine.graphs_on
    assert cosines(engine.submit(served(path, plain, TEXTS)).result(), ref).min() >= 0.999
