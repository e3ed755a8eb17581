"""fp8 products (`--quantization fp8`) on the CPU: the quantization against e4m3's own value grid,
the scaled product against the product of its dequantized operands, tiny models against HF
transformers, and the refusals. torch's CPU build has _scaled_mm and the float8 types, so the
numerics run here through the torch references (ops.quantize_rows and the *_fp8 compositions);
the fused CUDA kernels are checked against those same references on a GPU (test_cuda_fp8.py).
Serving fp8 on a CPU is refused: these tests quantize a loaded model directly."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import subprocess
import sys

import pytest
import torch
from torch import nn

from pollen.common.model_spec import UnsupportedModel
from pollen.server.config import ServeConfig
from pollen.worker.models import fp8, ops
from pollen.worker.models.loader import load_model
from tests.test_model_bert import make_tiny
from tests.test_model_qwen3 import engine_rows, hf_rows, make_tiny_qwen3, random_seqs

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_GRID = E4M3_VALUES[torch.isfinite(E4M3_VALUES)].unique()


def nearest_gap(values: torch.Tensor) -> torch.Tensor:
    """Each value's distance to the nearest number e4m3 can hold."""
    return (values.reshape(-1, 1) - E4M3_GRID.reshape(1, -1)).abs().min(dim=1).values.reshape(values.shape)


def test_each_row_is_scaled_to_448_and_rounded_to_the_nearest_e4m3_value():
    torch.manual_seed(0)
    x = torch.randn(6, 200)
    x[1] *= 1000  # an outlier token keeps its own scale
    x[2] *= 1e-3
    x[3] = 0  # an all-zero row quantizes to zeros, not NaN
    q, scale = ops.quantize_rows(x.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    amax = x.to(torch.bfloat16).float().abs().amax(dim=1, keepdim=True)
    live = amax.squeeze(1) > 0
    torch.testing.assert_close(scale[live], amax[live] / 448, rtol=1e-7, atol=0)
    assert q[3].float().abs().max() == 0 and torch.isfinite(scale).all()
    target = x.to(torch.bfloat16).float() / scale
    err = (q.float() - target).abs()
    assert (err <= nearest_gap(target) + 1e-6).all(), "a value is not rounded to the nearest e4m3 number"
    assert q.float().abs().amax(dim=1)[live].eq(448).all()  # each row's largest value maps to e4m3's largest


def test_weights_are_quantized_per_output_channel():
    torch.manual_seed(1)
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48).unsqueeze(1)  # rows of very different sizes
    q, scale = fp8.quantize_weight(w)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / 448, rtol=1e-7, atol=0)
    rel = (q.float() * scale[:, None] - w).abs() / w.abs()
    assert rel[w.abs() / scale[:, None] >= 2 ** -6].max() <= 2 ** -4 + 1e-6  # half an e4m3 step where normal


def test_an_fp8_product_is_the_product_of_its_dequantized_operands():
    torch.manual_seed(2)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    layer = fp8.Fp8Linear(linear, ops.quantize_rows)
    x8, xs = ops.quantize_rows(x)
    want = (x8.double() * xs.double()) @ (layer.weight_fp8.double() * layer.weight_scale.double().T).T
    want = want + linear.bias.double()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 48)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-2)  # bfloat16's rounding of the output
    cos = nn.functional.cosine_similarity(got.float(), linear(x).float(), dim=1)
    assert cos.min() > 0.995  # against the bfloat16 product: e4m3 keeps 3 bits of mantissa


class ScaledProducts:
    """Counts torch._scaled_mm calls (the fp8 products) while active."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = torch._scaled_mm

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "_scaled_mm", counted)


@pytest.mark.parametrize("kind", ["qwen3", "bert"])
def test_tiny_models_in_fp8_stay_close_to_transformers(tmp_path, monkeypatch, kind):
    """Every product of every layer runs in fp8 (counted), and the rows stay within what e4m3's
    rounding allows of HF transformers' float32 rows. Tiny random models are the harsh case: no
    trained structure, and each of their products as noisy as a large model's."""
    seqs = random_seqs([5, 30, 17, 64, 3], seed=5)
    if kind == "qwen3":
        hf = make_tiny_qwen3(tmp_path / "m", hidden_size=128, head_dim=32, intermediate_size=256)
        ref = hf_rows(hf, seqs, "causal")
    else:
        hf = make_tiny(tmp_path / "m")
        with torch.no_grad():
            ref = torch.stack([hf(input_ids=s[None]).last_hidden_state[0].mean(0) for s in seqs])
    model = load_model(str(tmp_path / "m"), dtype=torch.bfloat16)
    choice = fp8.quantize_model(model, measure=False)
    assert choice.min_tokens == 0
    products = ScaledProducts(monkeypatch)
    ours = engine_rows(model, seqs)
    assert products.calls == 4 * len(model.layers)
    cos = nn.functional.cosine_similarity(ours, ref.float(), dim=1)
    assert cos.min() > 0.99, cos


def test_batches_under_min_tokens_keep_the_bfloat16_products(tmp_path, monkeypatch):
    hf = make_tiny_qwen3(tmp_path / "m", hidden_size=128, head_dim=32, intermediate_size=256)
    seqs = random_seqs([5, 9], seed=6)
    model = load_model(str(tmp_path / "m"), dtype=torch.bfloat16)
    fp8.quantize_model(model, measure=False)
    for module in model.modules():
        if isinstance(module, fp8.Fp8Linear):
            module.min_tokens = 15
    model.after_quantize(15)
    products = ScaledProducts(monkeypatch)
    short = engine_rows(model, seqs)  # 14 tokens
    assert products.calls == 0
    cos = nn.functional.cosine_similarity(short, hf_rows(hf, seqs, "causal"), dim=1)
    assert cos.min() > 0.999  # bfloat16's own distance from float32
    engine_rows(model, random_seqs([5, 10], seed=6))  # 15 tokens
    assert products.calls == 4 * len(model.layers)


def test_min_tokens_is_where_fp8_wins_from_there_on():
    assert fp8.min_tokens_from([(16, 1.0, 2.0), (64, 1.0, 0.9), (256, 1.0, 1.1), (1024, 2.0, 1.0),
                                (4096, 8.0, 4.0)]) == 1024
    assert fp8.min_tokens_from([(16, 1.0, 0.5), (64, 1.0, 0.5)]) == 16
    assert fp8.min_tokens_from([(16, 1.0, 1.5), (64, 1.0, 1.0)]) == fp8.NEVER  # not faster at the last
    choice = fp8.Choice(fp8.NEVER, ((16, 1.0, 1.5), (64, 1.0, 1.0)))
    assert "never" in choice.describe() and "16: 1.50" in choice.describe()


def test_the_threshold_moves_to_just_past_a_graph_bucket(tmp_path):
    """A batch takes the same products eagerly (its own token count) and in its bucket's graph
    (padded to the bucket): the threshold sits one past a bucket, and a covering graph never
    crosses it."""
    make_tiny_qwen3(tmp_path / "m", hidden_size=128, head_dim=32, intermediate_size=256)
    model = load_model(str(tmp_path / "m"), dtype=torch.bfloat16)
    fp8.quantize_model(model, min_tokens=1000)
    fp8.align(model, [16, 32, 512, 960, 1200, 8192])
    assert model.fp8_choice.min_tokens == model.fp8_min_tokens == 961
    assert {m.min_tokens for m in model.modules() if isinstance(m, fp8.Fp8Linear)} == {961}
    assert fp8.same_products(model, 1200, 2000) and fp8.same_products(model, 512, 960)
    assert not fp8.same_products(model, 960, 1200)
    assert "from 961 tokens a batch" in model.fp8_choice.describe()


def test_where_fp8_never_wins_the_layers_stay_bfloat16(tmp_path):
    make_tiny_qwen3(tmp_path / "m", hidden_size=128, head_dim=32, intermediate_size=256)
    model = load_model(str(tmp_path / "m"), dtype=torch.bfloat16)
    names = [name for name, _ in model.named_parameters()]
    choice = fp8.quantize_model(model, min_tokens=fp8.NEVER)
    assert choice.min_tokens == fp8.NEVER and model.fp8_min_tokens is None
    assert not any(isinstance(m, fp8.Fp8Linear) for m in model.modules())
    assert [name for name, _ in model.named_parameters()] == names
    fp8.align(model, [16, 64])  # nothing to align
    assert model.fp8_choice.min_tokens == fp8.NEVER


def test_an_fp8_model_keeps_its_parameter_names(tmp_path):
    make_tiny(tmp_path / "m")
    model = load_model(str(tmp_path / "m"), dtype=torch.bfloat16)
    names = [name for name, _ in model.named_parameters()]
    fp8.quantize_model(model, measure=False)
    assert [name for name, _ in model.named_parameters()] == names


def test_the_threshold_can_be_set_as_an_engine_option():
    from pollen.common.engine_options import EngineOptions

    options = EngineOptions.parse("fp8_min_tokens=2048")
    assert options.fp8_min_tokens == 2048 and options.serve_flags() == ["--fp8-min-tokens", "2048"]
    with pytest.raises(ValueError, match="fp8_min_tokens"):
        EngineOptions(fp8_min_tokens=-1)
    cfg = ServeConfig.from_args(["--fp8-min-tokens", "512"], environ={})
    assert cfg.engine_options().fp8_min_tokens == 512
    assert ServeConfig.from_args([], environ={}).engine_options().fp8_min_tokens == 0


def test_fp8_is_refused_where_it_cannot_run(tmp_path):
    make_tiny(tmp_path / "m")
    with pytest.raises(UnsupportedModel, match="--quantization fp8 is refused: .*not the cpu"):
        load_model(str(tmp_path / "m"), dtype=torch.bfloat16, quantization="fp8")
    with pytest.raises(UnsupportedModel, match="quantization must be one of none, fp8"):
        load_model(str(tmp_path / "m"), quantization="int4")
    for argv, words in ((["--quantization", "fp8"], "needs --device cuda"),
                        (["--quantization", "fp4"], "must be none or fp8"),
                        (["--model", "a", "--model", "b", "--quantization", "fp8,none,fp8"], "3 values for 2 models")):
        with pytest.raises(ValueError, match=words):
            ServeConfig.from_args(argv, environ={})


def test_serve_refuses_fp8_on_the_cpu_in_one_line():
    done = subprocess.run([sys.executable, "-m", "pollen.server.cli", "serve", "--quantization", "fp8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--quantization fp8 needs --device cuda" in lines[0], done.stderr


def test_quantization_is_given_per_model():
    cfg = ServeConfig.from_args(["--model", "a", "--model", "b"], environ={})
    assert cfg.quantizations() == ["none", "none"]
    cfg = ServeConfig.from_args(["--model", "a", "--model", "b"], environ={"POLLEN_QUANTIZATION": "none,none"})
    assert cfg.quantizations() == ["none", "none"]
