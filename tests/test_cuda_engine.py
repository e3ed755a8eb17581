"""The CUDA engine on a real GPU: fused kernels vs their torch references, graphs vs eager, and
tiny Qwen3 / BERT checkpoints vs HF transformers. Skipped cleanly where no GPU is visible (CI);
run on the GPU machine (load/device_gpu_tests.sh)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (load/run_gpu.sh runs them on a GPU host)")]

from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.common.request import Lane  # noqa: E402
from pollen.worker.eager_engine import EagerEngine  # noqa: E402
from pollen.worker.models import ops  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import RowSpans, pack  # noqa: E402


def cos(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b, dim=1).min().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_equal_references(dtype):
    pytest.importorskip("triton")
    from pollen.worker.kernels.fused import triton_ops

    kernels = triton_ops("torch_varlen", EngineOptions())
    torch.manual_seed(0)
    t, h, heads, kv, d, inter = 333, 1024, 16, 8, 128, 3072
    x, r = (torch.randn(t, h, device="cuda", dtype=dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(h, device="cuda")).to(dtype)
    for res in (r, None):
        y, s = kernels.add_rms_norm(x, res, w, 1e-6)
        y0, s0 = ops.add_rms_norm(x, res, w, 1e-6)
        torch.testing.assert_close(s, s0, rtol=0, atol=0)
        torch.testing.assert_close(y, y0, rtol=1e-2, atol=1e-2)  # one bf16 rounding step apart at most
    qkv = torch.randn(t, (heads + 2 * kv) * d, device="cuda", dtype=dtype)
    qw, kw = ((1 + 0.3 * torch.randn(d, device="cuda")).to(dtype) for _ in range(2))
    cache = ops.rope_cache(1e6, d, 4096, "cuda")
    pos = torch.randint(0, 4096, (t,), device="cuda", dtype=torch.int32)
    for a, b in zip(kernels.qk_norm_rope(qkv, qw, kw, cache, pos, heads, kv, 1e-6),
                    ops.qk_norm_rope(qkv, qw, kw, cache, pos, heads, kv, 1e-6)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=2e-2)
    gu = torch.randn(t, 2 * inter, device="cuda", dtype=dtype)
    torch.testing.assert_close(kernels.silu_mul(gu), ops.silu_mul(gu), rtol=1e-2, atol=1e-2)


def tiny(tmp_path, kind):
    if kind == "bert":
        from tests.test_model_bert import make_tiny

        make_tiny(tmp_path / "m")
    else:
        from tests.test_model_qwen3 import make_tiny_qwen3

        make_tiny_qwen3(tmp_path / "m", kind)
    return str(tmp_path / "m")


def seqs(lengths, vocab=1000, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n, dtype=np.int32) for n in lengths]


@pytest.mark.parametrize("kind", ["causal", "bidirectional", "bert"])
def test_cuda_engine_matches_cpu_reference(tmp_path, kind):
    from pollen.worker.cuda_engine import CudaEngine

    path = tiny(tmp_path, kind)
    batch = pack(seqs([1, 9, 2, 40, 64, 13, 3]))
    ref = EagerEngine(load_model(path)).submit(batch).result()
    fp32 = CudaEngine(load_model(path, "cuda", torch.float32), "cuda", max_batch_tokens=512)
    assert cos(fp32.submit(batch).result(), ref) >= 0.99999
    for graphs in (False, True):
        engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=512,
                            cuda_graphs=graphs)
        engine.warm_up()
        first = engine.submit(batch)
        second = engine.submit(batch)  # submitted before the first is read: the overlap path
        a, b = first.result().copy(), second.result().copy()
        assert cos(a, ref) >= 0.999 and cos(b, ref) >= 0.999
        np.testing.assert_array_equal(a, b)
        if graphs:
            assert len(engine.graphs) == 1  # the same bucket replayed


def test_graphs_pool_spans_and_buckets(tmp_path):
    """Contextual-chunk spans and odd sizes through graphs equal the CPU reference; batches above
    the largest graph bucket run eagerly."""
    from pollen.worker.cuda_engine import CudaEngine

    path = tiny(tmp_path, "bidirectional")
    cpu = EagerEngine(load_model(path))
    engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=512,
                        graph_max_tokens=128)
    engine.warm_up()
    docs = seqs([50, 7, 30], seed=3)
    spans = [[(0, 10), (10, 50)], [(0, 7)], [(2, 5), (5, 6), (6, 30)]]
    for batch in (pack(docs, RowSpans.of(spans)), pack(seqs([5] * 17 + [60], seed=4)), pack(seqs([64] * 6, seed=5))):
        got = engine.submit(batch).result()
        assert got.shape == (batch.rows, 64)
        assert cos(got, cpu.submit(batch).result()) >= 0.999
    assert all(shape[0] <= 128 for shape in engine.graphs)


@pytest.mark.parametrize("causal", [False, True])
def test_short_attention_equals_flash(causal):
    pytest.importorskip("triton")
    from pollen.worker.kernels.norms import embed_rms_norm
    from pollen.worker.kernels.short_attention import short_attention
    from pollen.worker.models.attention import _torch_varlen, _torch_varlen_options

    torch.manual_seed(1)
    cu = torch.tensor([0, 5, 5, 21, 22, 86], dtype=torch.int32, device="cuda")  # an empty and a 64-long one
    for heads, kv, d in ((16, 8, 128), (12, 12, 64)):
        q = torch.randn(86, heads, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(86, kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = _torch_varlen(q, k, v, cu, cu, 64, 64, **_torch_varlen_options(causal, kv != heads))
        torch.testing.assert_close(short_attention(q, k, v, cu, 64, causal), ref, rtol=2e-2, atol=2e-2)
    # BERT's q, k, v are strided views of one fused projection.
    q, k, v = torch.randn(86, 3, 12, 64, device="cuda", dtype=torch.bfloat16).unbind(1)
    ref = _torch_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 64, 64,
                        **_torch_varlen_options(causal, False))
    torch.testing.assert_close(short_attention(q, k, v, cu, 64, causal), ref, rtol=2e-2, atol=2e-2)

    ids = torch.randint(0, 1000, (40,), device="cuda", dtype=torch.int32)
    table = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.3 * torch.randn(1024, device="cuda")).to(torch.bfloat16)
    y, rows = embed_rms_norm(ids, table, w, 1e-6)
    y0, rows0 = ops.embed_rms_norm(ids.long(), table, w, 1e-6)
    assert torch.equal(rows, rows0)
    torch.testing.assert_close(y, y0, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_short_qk_rope_attention_equals_the_separate_kernels(causal):
    pytest.importorskip("triton")
    from pollen.worker.kernels.short_attention import short_qk_rope_attention
    from pollen.worker.models.attention import VarlenAttention, backend

    torch.manual_seed(2)
    heads, kv, d = 16, 8, 128
    cu = torch.tensor([0, 5, 5, 21, 22, 86], dtype=torch.int32, device="cuda")
    pos = torch.cat([torch.arange(n) for n in (5, 16, 1, 64)]).to("cuda", torch.int32)
    qkv = torch.randn(86, (heads + 2 * kv) * d, device="cuda", dtype=torch.bfloat16)
    qw, kw = ((1 + 0.3 * torch.randn(d, device="cuda")).to(torch.bfloat16) for _ in range(2))
    cache = ops.rope_cache(1e6, d, 4096, "cuda")
    q, k, v = ops.qk_norm_rope(qkv, qw, kw, cache, pos, heads, kv, 1e-6)
    flash = VarlenAttention(backend(q.device, q.dtype, EngineOptions()))  # the reference: no short kernel
    assert flash.kind != "sdpa_loop" and flash.short is None
    ref = flash(q, k, v, cu, 64, causal)
    got = short_qk_rope_attention(qkv, qw, kw, cache, pos, heads, kv, 1e-6, cu, 64, causal)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_products_equal_the_separate_kernels(dtype):
    """Each skinny product equals the kernels it replaces, for 1 to 64 rows, eagerly and replayed in
    a graph: the residual add (bit for bit) with its sums of squares, the norm folded into the
    product (within one rounding of the product's input), and SiLU-gate."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from pollen.worker.kernels.skinny import skinny_linear

    g = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, device="cuda", generator=g)).to(dtype)

    k, n, inter = 1024, 512, 384
    gamma = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).to(dtype)
    w_o, b_o, w_qkv, w_gu = rnd(k, n, s=0.03), rnd(k, s=0.1), rnd(n, k, s=0.03), rnd(2 * inter, k, s=0.03)
    fold = lambda w: (w.float() * gamma.float()).to(dtype)  # noqa: E731  what Qwen3Encoder.after_load does
    for m in (1, 16, 37, 64):
        attn, r = rnd(m, n), rnd(m, k)
        cases = {}
        # o: the new residual and its per-row sums of squares
        same = (16, 256, 4, 4, 1)  # one tiling for both, so both sum in the same order
        s, parts = skinny_linear(attn, w_o, b_o, residual=r, config=same)
        assert torch.equal(s, skinny_linear(attn, w_o, b_o, config=same) + r)
        torch.testing.assert_close(parts.data[:parts.count, :m].sum(0), s.float().pow(2).sum(1), rtol=1e-5, atol=1e-3)
        cases["residual"] = (lambda: skinny_linear(attn, w_o, b_o, residual=r, config=same)[0], s)
        split = (16, 128, 4, 4, 4)  # K in four shares, summed by the last program to arrive
        s4, parts4 = skinny_linear(attn, w_o, b_o, residual=r, config=split)
        torch.testing.assert_close(s4, s, rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(parts4.data, parts.data, rtol=1e-2, atol=1e-1)
        cases["residual_split"] = (lambda: skinny_linear(attn, w_o, b_o, residual=r, config=split)[0], s4)
        normed = ops.rms_norm(s, gamma, 1e-6)
        # qkv: the norm of that residual folded into the product
        want = F.linear(normed, w_qkv)
        got = skinny_linear(s, fold(w_qkv), parts=parts, eps=1e-6)
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < 2e-2, m
        cases["norm"] = (lambda: skinny_linear(s, fold(w_qkv), parts=parts, eps=1e-6), got)
        # gate/up with SiLU-gate
        want = ops.silu_mul(F.linear(normed, w_gu))
        got = skinny_linear(s, fold(w_gu), parts=parts, eps=1e-6, swiglu=True)
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < 2e-2, m
        cases["swiglu"] = (lambda: skinny_linear(s, fold(w_gu), parts=parts, eps=1e-6, swiglu=True), got)
        # plain, with a bias
        torch.testing.assert_close(skinny_linear(attn, w_o, b_o), F.linear(attn, w_o, b_o), rtol=1e-2, atol=1e-2)
        for name, (fn, eager) in cases.items():  # a graph replays the same bits (no atomics)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            for _ in range(3):  # again and again: split-K's arrival counters must come back to zero
                out.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, eager), (name, m)


@pytest.mark.parametrize("kind", ["causal", "bidirectional"])
def test_query_path_matches_cpu_reference(tmp_path, kind):
    """Batches of up to 64 tokens take the five-kernel layer (skinny products) and still equal the
    float32 CPU reference; a 65-token batch takes the general path."""
    import dataclasses

    from pollen.worker.cuda_engine import CudaEngine
    from tests.test_model_qwen3 import make_tiny_qwen3

    make_tiny_qwen3(tmp_path / "m", kind, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, intermediate_size=512, num_hidden_layers=2, max_position_embeddings=256)
    path = str(tmp_path / "m")
    calls = []
    cpu = EagerEngine(load_model(path))
    for graphs in (False, True):
        model = load_model(path, "cuda", torch.bfloat16)
        assert model.ops.name == "triton" and model.query_kernels
        real = model.ops.skinny_linear
        model.ops = dataclasses.replace(model.ops, skinny_linear=lambda *a, **k: calls.append(1) or real(*a, **k))
        engine = CudaEngine(model, "cuda", max_batch_tokens=512, cuda_graphs=graphs)
        engine.warm_up()
        for lengths in ([16], [9], [3, 20, 7], [30, 34], [65]):
            batch = pack(seqs(lengths, seed=len(lengths)))
            calls.clear()
            got = engine.submit(batch).result()
            assert cos(got, cpu.submit(batch).result()) >= 0.999, (graphs, lengths)
            if not graphs:  # eagerly, every call is visible: four products a layer, two layers
                assert len(calls) == (8 if sum(lengths) <= 64 else 0), lengths


@pytest.mark.parametrize("options, query_calls", [
    (EngineOptions(), 8), (EngineOptions(skinny=False), 0), (EngineOptions(fold_norms=False), 0),
    (EngineOptions(short_attention=False), 8), (EngineOptions(triton=False), 0),
    (EngineOptions(flash_attn=False), 8)])
def test_each_engine_option_switches_its_kernels(tmp_path, options, query_calls):
    """Each option turns off exactly its kernels, and every combination still equals the CPU
    reference: a 16-token query through the skinny products (two layers, four each) or not, short
    attention or the varlen kernel, flash_attn or torch's varlen_attn."""
    import dataclasses

    from pollen.worker.cuda_engine import CudaEngine
    from tests.test_model_qwen3 import make_tiny_qwen3

    if options.triton:
        pytest.importorskip("triton")
    make_tiny_qwen3(tmp_path / "m", "causal", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, intermediate_size=512, num_hidden_layers=2, max_position_embeddings=256)
    path = str(tmp_path / "m")
    model = load_model(path, "cuda", torch.bfloat16, options=options)
    assert model.ops.name == ("triton" if options.triton else "torch")
    assert model.attention.kind != "flash_attn" or options.flash_attn
    has_short = options.triton and options.short_attention
    assert (model.short_qk_rope_attention is not None) == has_short == (model.attention.short is not None)
    calls = []
    if model.ops.skinny_linear is not None:
        real = model.ops.skinny_linear
        model.ops = dataclasses.replace(model.ops, skinny_linear=lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = CudaEngine(model, "cuda", max_batch_tokens=512, cuda_graphs=False)
    batch = pack(seqs([16], seed=6))
    got = engine.submit(batch).result()
    assert len(calls) == query_calls
    assert cos(got, EagerEngine(load_model(path)).submit(batch).result()) >= 0.999


def test_small_batches_on_both_lanes_at_once(tmp_path):
    """Small batches on both lanes at once (the query kernels, split K included, on two streams
    of different priority) all equal the CPU reference: each stream keeps its own split-K arrival
    counters (shared ones let one lane's launch finish another's column block)."""
    from pollen.worker.cuda_engine import CudaEngine
    from tests.test_model_qwen3 import make_tiny_qwen3

    # Qwen3-0.6B's widths, so the products take their real tile configurations (split K for o and down).
    make_tiny_qwen3(tmp_path / "m", "causal", hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                    head_dim=128, intermediate_size=3072, num_hidden_layers=2, max_position_embeddings=512)
    path = str(tmp_path / "m")
    cpu = EagerEngine(load_model(path))
    engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=4096)
    small = [pack(seqs([n, 40 - n], seed=n)) for n in (5, 11, 17)]
    queries = [pack(seqs([n], seed=30 + n)) for n in (4, 9, 16, 27)]
    want = {id(b): cpu.submit(b).result() for b in small + queries}
    for b in small:
        engine.submit(b, lane=Lane.BULK).result()
    for b in queries:
        engine.submit(b, lane=Lane.INTERACTIVE).result()
    for _ in range(20):
        pending = [(b, engine.submit(b, lane=Lane.BULK)) for b in small]
        pending += [(b, engine.submit(b, lane=Lane.INTERACTIVE)) for b in queries]
        for b, p in pending:
            assert cos(p.result(), want[id(b)]) >= 0.999, b.tokens


def test_lanes_run_side_by_side_and_equal_the_reference(tmp_path):
    """A bulk batch on the low-priority lane and interactive batches launched behind it on the
    high-priority lane: every result equals the CPU reference, and the interactive ones can be
    done before the bulk one (they do not queue behind it)."""
    from pollen.worker.cuda_engine import CudaEngine

    path = tiny(tmp_path, "causal")
    cpu = EagerEngine(load_model(path))
    engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=8192)
    engine.warm_up()
    bulk = pack(seqs([64] * 120, seed=7))  # 7,680 tokens, eager on the bulk lane
    queries = [pack(seqs([n], seed=8 + n)) for n in (5, 9, 17, 30)]
    want_bulk = cpu.submit(bulk).result()
    for q in queries:
        engine.submit(q, lane=Lane.INTERACTIVE).result()  # capture their graphs first
    pending_bulk = engine.submit(bulk, lane=Lane.BULK)
    pending = [engine.submit(q, lane=Lane.INTERACTIVE) for q in queries[:2]]
    got = [p.result().copy() for p in pending]
    pending += [engine.submit(q, lane=Lane.INTERACTIVE) for q in queries[2:]]
    got += [p.result().copy() for p in pending[2:]]
    for q, rows in zip(queries, got):
        assert cos(rows, cpu.submit(q).result()) >= 0.999
    assert cos(pending_bulk.result(), want_bulk) >= 0.999


def test_deferred_capture_runs_eagerly_then_captures_when_idle(tmp_path):
    """With defer_capture, a bucket first met runs eagerly (no capture on its path) and is
    captured by capture_one; the graph's result equals the eager one."""
    from pollen.worker.cuda_engine import CudaEngine

    path = tiny(tmp_path, "bidirectional")
    engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=512, defer_capture=True)
    engine.warm_up()
    batch = pack(seqs([7, 12, 3], seed=11))
    eager = engine.submit(batch).result().copy()
    assert not engine.graphs and len(engine.wanted) == 1
    assert engine.capture_one() and not engine.capture_one()
    assert len(engine.graphs) == 1 and not engine.wanted
    graphed = engine.submit(batch).result()
    assert cos(graphed, eager) >= 0.9999


def test_a_bucket_met_often_under_load_is_captured_on_demand(tmp_path):
    """The eager batches of a missed bucket are counted; capture_one(n) captures the interactive
    lane's most met bucket only once n batches ran in it (between_batches captures under load so),
    and the graph then answers what the eager runs did."""
    from pollen.worker.cuda_engine import CudaEngine

    path = tiny(tmp_path, "causal")
    engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=512, defer_capture=True)
    engine.warm_up()
    batch = pack(seqs([9, 14, 5, 21], seed=13))
    eager = [engine.submit(batch).result().copy() for _ in range(3)]
    assert list(engine.wanted.values()) == [3] and not engine.graphs
    assert engine.most_wanted(3) is not None and engine.most_wanted(4) is None
    assert not engine.capture_one(4) and not engine.graphs
    assert engine.capture_one(3) and len(engine.graphs) == 1 and not engine.wanted
    assert cos(engine.submit(batch).result(), eager[0]) >= 0.9999


@pytest.mark.parametrize("kind", ["causal", "bidirectional", "bert"])
def test_a_batch_without_its_own_graph_runs_padded_in_a_larger_one(tmp_path, kind):
    """A bucket met under load with no graph of its own runs in the smallest larger captured graph
    (padded tokens, sequences and rows) rather than eagerly, and answers what the eager run does;
    a batch no graph holds runs eagerly. The counts say which ran how, and the padded bucket is
    captured when the lane idles."""
    from pollen.worker.cuda_engine import CudaEngine

    path = tiny(tmp_path, kind)
    engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=512, defer_capture=True)
    engine.warm_up()
    small, large = pack(seqs([7, 12, 3], seed=21)), pack(seqs([9, 14, 5, 21, 6], seed=22))
    assert engine.bucket(small) < engine.bucket(large)
    eager_small = engine.submit(small).result().copy()
    eager_large = engine.submit(large).result().copy()
    assert engine.counts.tolist() == [2, 0, 0] and len(engine.wanted) == 2
    with torch.inference_mode():
        engine.capture(engine.bucket(large))
    engine.wanted.clear()
    for _ in range(2):  # again: the padding is rewritten each time
        got = engine.submit(small).result().copy()
        assert got.shape == eager_small.shape and cos(got, eager_small) >= 0.9999
    assert engine.counts.tolist() == [2, 2, 1] and list(engine.padded.values()) == [2]
    assert cos(engine.submit(large).result(), eager_large) >= 0.9999
    too_large = pack(seqs([60, 61, 62], seed=23))  # more than the graph's tokens: eager
    engine.submit(too_large).result()
    assert engine.counts.tolist() == [3, 2, 1]
    assert engine.capture_one() and engine.capture_one() and not engine.capture_one()  # eager first, then padded
    assert not engine.padded and len(engine.graphs) == 3
    assert cos(engine.submit(small).result(), eager_small) >= 0.9999


def test_warm_up_captures_the_query_buckets_within_its_budget(tmp_path):
    from pollen.worker.cuda_engine import CudaEngine

    path = tiny(tmp_path, "causal")
    engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=512, defer_capture=True)
    engine.warm_up(budget_s=60.0)
    expected = engine.query_buckets()
    assert expected and set(expected) <= set(engine.graphs)
    batch = pack(seqs([11, 8, 14, 9], seed=12))  # four queries: a bucket the warm-up captured
    engine.submit(batch).result()
    assert not engine.wanted


def test_bulk_lane_in_a_green_context_equals_the_reference(tmp_path):
    """--bulk-sms: the bulk lane's streams come from a green context of that many SMs; its eager
    and graphed batches (the graph captured on that stream) equal the CPU reference, and the
    default leaves an eighth of the SMs (at least 8) to the interactive lane."""
    from pollen.worker.cuda_engine import CudaEngine
    from pollen.worker.sm_partition import green_contexts_supported

    if not green_contexts_supported():
        pytest.skip("this torch has no CUDA green contexts")
    total = torch.cuda.get_device_properties(0).multi_processor_count
    path = tiny(tmp_path, "causal")
    cpu = EagerEngine(load_model(path))
    engine = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=2048, bulk_sms=64)
    assert engine.bulk_sms == 64 and engine.lanes[Lane.BULK].partition is not None
    assert engine.lanes[Lane.INTERACTIVE].partition is None
    engine.warm_up()
    batch = pack(seqs([40, 64, 7, 50], seed=12))
    want = cpu.submit(batch).result()
    first = engine.submit(batch, lane=Lane.BULK).result().copy()  # captures its bucket on the green stream
    assert engine.bucket(batch) in engine.lanes[Lane.BULK].graphs
    pending = engine.submit(batch, lane=Lane.BULK)  # the graph replayed beside an interactive batch
    query = engine.submit(pack(seqs([9], seed=13)), lane=Lane.INTERACTIVE)
    assert cos(first, want) >= 0.999 and cos(pending.result(), want) >= 0.999
    assert cos(query.result(), cpu.submit(pack(seqs([9], seed=13))).result()) >= 0.999
    # A bulk launch that raises (rows for a buffer of the wrong size) leaves the interactive
    # lane's stream current, never the green context's.
    with pytest.raises(RuntimeError):
        engine.submit(batch, out=np.empty((1, engine.hidden + 1), np.float32), lane=Lane.BULK)
    assert torch.cuda.current_stream() == engine.lanes[Lane.INTERACTIVE].stream
    default = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", max_batch_tokens=512, bulk_sms=-1)
    assert default.bulk_sms == total - max(8, total // 8)
