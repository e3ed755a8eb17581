"""fp8 products on a GPU that has them (compute capability 8.9 or later): the fused quantizing
kernels against their torch references, the fp8 model through the CUDA engine's graphs against
its eager references and against bfloat16, the load-time choice of where fp8 runs, and
`pollen serve --quantization fp8` end to end. Skipped where no such GPU is visible (CI)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import urllib.request

import grpc
import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU with fp8 products (load/run_gpu.sh runs them on a GPU host)")]

from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from pollen.worker.models import fp8, ops  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def assert_same_quantization(got, want):
    """Two (e4m3, scales) pairs quantize the same values: the scales agree to a bfloat16 step (the
    kernels and the references may round a norm's output one step apart), every dequantized value
    within one e4m3 step of the other, and almost every code equal."""
    (q, s), (q0, s0) = got, want
    torch.testing.assert_close(s, s0, rtol=1e-2, atol=0)
    a, b = q.float() * s, q0.float() * s0
    assert ((a - b).abs() <= 0.14 * b.abs() + s0 * 2 ** -9).all()  # a step (1/8) at the scales' rtol
    assert (q.float() != q0.float()).float().mean() < 0.1  # a scale a bf16 step apart moves a few codes


def test_quantizing_kernels_equal_their_references():
    from pollen.worker.kernels import norms, quant

    torch.manual_seed(0)
    t, h, inter = 333, 1024, 3072
    x, r = (torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = (1 + 0.3 * torch.randn(h, device="cuda")).to(torch.bfloat16)
    for res in (r, None):
        q, s, summed = norms.add_rms_norm_fp8(x, res, w, 1e-6)
        q0, s0, summed0 = ops.add_rms_norm_fp8(x, res, w, 1e-6)
        assert torch.equal(summed, summed0)
        assert_same_quantization((q, s), (q0, s0))
    ids = torch.randint(0, 1000, (t,), device="cuda", dtype=torch.int32)
    table = torch.randn(1000, h, device="cuda", dtype=torch.bfloat16)
    q, s, rows = norms.embed_rms_norm_fp8(ids, table, w, 1e-6)
    q0, s0, rows0 = ops.embed_rms_norm_fp8(ids.long(), table, w, 1e-6)
    assert torch.equal(rows, rows0)
    assert_same_quantization((q, s), (q0, s0))
    gu = 3 * torch.randn(t, 2 * inter, device="cuda", dtype=torch.bfloat16)
    assert_same_quantization(quant.silu_mul_fp8(gu), ops.silu_mul_fp8(gu))
    wide = torch.randn(t, 2100, device="cuda", dtype=torch.bfloat16)  # not a multiple of the block
    wide[5] = 0
    assert_same_quantization(quant.quantize_rows(wide), ops.quantize_rows(wide))


def mid_qwen3(tmp_path):
    """A Qwen3 of the 0.6B shape's layer widths, four layers deep."""
    from load.gpu_models import write_tokenizer
    from tests.test_model_qwen3 import make_tiny_qwen3

    make_tiny_qwen3(tmp_path / "m", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, intermediate_size=3072, max_position_embeddings=4096)
    write_tokenizer(str(tmp_path / "m"), 1000)
    return str(tmp_path / "m")


def docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, int(k), dtype=np.int32) for k in rng.integers(20, 300, n)]


def test_the_fp8_model_through_graphs_equals_its_references(tmp_path):
    """The fused kernels' fp8 forward in CUDA graphs against the same model with the torch
    references eagerly (the same quantization, unfused), and both against bfloat16; the load's
    choice covers every measured size and is what its timings say."""
    from pollen.worker.cuda_engine import CudaEngine

    path = mid_qwen3(tmp_path)
    model = load_model(path, "cuda", torch.bfloat16, quantization="fp8")
    choice = model.fp8_choice
    assert [t for t, _, _ in choice.timings] == list(fp8.MEASURED_TOKENS)
    assert choice.min_tokens == fp8.min_tokens_from(list(choice.timings))
    print(choice.describe())
    if choice.min_tokens >= fp8.NEVER:  # the measurement kept bfloat16: quantize again, from every size
        model = load_model(path, "cuda", torch.bfloat16, options=EngineOptions(fp8_min_tokens=1), quantization="fp8")
    fp8.set_min_tokens(model, 0)  # every size in fp8 here, whatever the measurement chose
    engine = CudaEngine(model, "cuda", max_batch_tokens=8192)
    assert model.fp8_choice.min_tokens == 0  # aligned to the buckets: still every size
    engine.warm_up()
    batch = pack(docs(24))
    got = engine.submit(batch).result().copy()
    assert len(engine.graphs) >= 1

    reference = load_model(path, "cuda", torch.bfloat16, options=EngineOptions(triton=False, fp8_min_tokens=1),
                           quantization="fp8")
    fp8.set_min_tokens(reference, 0)
    assert reference.ops.name == "torch"
    want = CudaEngine(reference, "cuda", cuda_graphs=False).submit(pack(docs(24))).result().copy()
    # Two fp8 pipelines agree only as far as their bfloat16 kernels do: the Triton and torch
    # attention, norms and RoPE differ in bfloat16's last bit, and e4m3 then rounds a few percent
    # of those values to the other neighbour, so the rows move by about fp8's own step (a tenth of
    # a percent in cosine over these four layers). A wrong scale or a skipped quantization moves
    # them by far more; the kernels equal the references on the same inputs (the test above).
    fused_vs_reference = cosines(got, want)
    assert fused_vs_reference.mean() >= 0.998 and fused_vs_reference.min() >= 0.995

    bf16 = CudaEngine(load_model(path, "cuda", torch.bfloat16), "cuda", cuda_graphs=False).submit(
        pack(docs(24))).result().copy()
    # How far fp8 may move a row from bfloat16 is the quantization's own doing (random weights
    # of this shape lose about 1% of cosine to e4m3 in any implementation): the bar is how far
    # the torch references' fp8 moves it, and the fused kernels may not move it further.
    c, r = cosines(got, bf16), cosines(want, bf16)
    print(f"fp8 against bfloat16, 4 layers of the 0.6B shape: fused cosine mean {c.mean():.5f} min {c.min():.5f}; "
          f"torch references mean {r.mean():.5f} min {r.min():.5f}")
    assert c.mean() >= r.mean() - 1e-3 and c.min() >= r.min() - 5e-3
    assert c.mean() >= 0.98  # and the references themselves are fp8, not something further off


def test_the_measured_choice_is_logged_and_holds_eager_and_in_graphs(tmp_path):
    """The measured threshold, aligned to the engine's buckets: a batch just under it and one just
    over it take the products their side says, eagerly and from their bucket's graph alike."""
    from pollen.worker.cuda_engine import CudaEngine

    model = load_model(mid_qwen3(tmp_path), "cuda", torch.bfloat16, quantization="fp8")
    engine = CudaEngine(model, "cuda", max_batch_tokens=8192)
    threshold = model.fp8_choice.min_tokens
    print(model.fp8_choice.describe())
    if threshold >= fp8.NEVER or threshold == 0:
        pytest.skip(f"the measurement chose {model.fp8_choice.describe()}: no size on each side to check")
    assert threshold - 1 in engine.buckets  # one past a bucket
    calls = []
    real = torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    torch._scaled_mm = counted
    try:
        for tokens in (threshold - 1, threshold):
            texts = [np.arange(1, n + 1, dtype=np.int32) for n in [500] * (tokens // 500) + [tokens % 500] if n]
            for _ in range(2):  # the graph's capture, then its replay (the capture calls the products)
                engine.submit(pack(texts)).result()
    finally:
        torch._scaled_mm = real
    assert calls and all(rows >= threshold for rows in calls)  # the side over it only, and it did


def test_default_loads_no_fp8(tmp_path):
    model = load_model(mid_qwen3(tmp_path), "cuda", torch.bfloat16)
    assert model.fp8_choice is None
    assert not any(isinstance(m, fp8.Fp8Linear) for m in model.modules())


def test_serve_with_fp8_answers_close_to_bfloat16(tmp_path):
    """`pollen serve --quantization fp8` logs its choice, says fp8 in Info and /v1/models, and
    answers vectors close to a bfloat16 server's on the same texts (token ids, graphs on; fp8 from
    every size, --fp8-min-tokens, so that the batch surely takes it)."""
    path = mid_qwen3(tmp_path)
    texts = docs(40, seed=3)
    rows = {}
    for mode in ("none", "fp8"):
        log = str(tmp_path / f"{mode}.log")
        server = ServerProcess("--model", path, "--device", "cuda", "--quantization", mode, "--fp8-min-tokens", "16",
                               log=log).start(timeout=300)
        try:
            with grpc.insecure_channel(server.listen) as channel:
                stub = pb_grpc.EmbedderStub(channel)
                info = stub.Info(pb.InfoRequest())
                assert info.models[0].quantization == mode
                request = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=t.tolist()) for t in texts])
                answer = stub.Embed(request, timeout=60)
                rows[mode] = np.frombuffer(answer.embeddings, np.float32).reshape(answer.rows, answer.dims)
            url = f"http://127.0.0.1:{server.http_port}/v1/models"
            assert json.loads(urllib.request.urlopen(url, timeout=30).read())["data"][0]["quantization"] == mode
        finally:
            server.terminate()
        with open(log) as f:
            logged = f.read()
        assert ("fp8 products from 0 tokens a batch" in logged) == (mode == "fp8"), logged[-2000:]
    assert cosines(rows["fp8"], rows["none"]).min() >= 0.98
