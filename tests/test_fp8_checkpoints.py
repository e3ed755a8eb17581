"""Checkpoints stored in fp8 (common/stored_quantization.py): compressed-tensors folders written by
the compressed-tensors library itself (per-channel, per-tensor and per-block scales) give the rows
of transformers' own model loaded from them (which decompresses them with that library); the
FBGEMM and fine-grained fp8 layouts give the rows of the model whose weights are their values
multiplied out; every other quantized format is refused at start in one line naming it."""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from pollen.common.model_spec import UnsupportedModel, read_model_spec
from pollen.worker.models.loader import load_model
from tests.test_model_qwen3 import assert_matches, engine_rows, hf_rows, make_tiny_qwen3, random_seqs

LENGTHS = [1, 5, 17, 40]


def block_args(block: int):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                            block_structure=[block, block], dynamic=False)


def compressed_tensors_folder(path, scheme: str) -> None:
    """Rewrite the tiny Qwen3 in `path` as llm-compressor saves it: the compressed-tensors library
    puts its quantization on every Linear of the layers, computes each weight's scales from its
    min and max, compresses the weights to e4m3 and writes config.json's quantization_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    if scheme == "block":
        chosen = QuantizationScheme(targets=["Linear"], weights=block_args(32),
                                    input_activations=preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).input_activations)
    else:
        chosen = preset_name_to_scheme(scheme, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": chosen}))
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "weight_scale"):
                continue
            w, shape = module.weight.float(), module.weight_scale.shape
            if scheme == "block":
                n, k = w.shape
                blocks = w.reshape(n // 32, 32, k // 32, 32)
                lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
            elif shape.numel() == 1:
                lo, hi = w.amin().reshape(shape), w.amax().reshape(shape)
            else:
                lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
            scale, _ = calculate_qparams(lo, hi, module.quantization_scheme.weights)
            module.weight_scale.copy_(scale.reshape(shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))


def transformers_reference(path):
    """transformers' model from the folder (the compressed-tensors integration decompresses the
    weights), its activation quantization off: the stored weights, multiplied out, in float32."""
    from compressed_tensors.quantization import disable_quantization
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    model.apply(disable_quantization)
    return model


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8", "block"])
def test_compressed_tensors_fp8_folder_gives_transformers_rows(tmp_path, scheme):
    path = tmp_path / "m"
    plain = make_tiny_qwen3(path)
    seqs = random_seqs(LENGTHS)
    with torch.no_grad():
        plain_rows = hf_rows(plain, seqs, "causal")
    compressed_tensors_folder(path, scheme)
    stored = load_file(str(path / "model.safetensors"))
    assert stored["layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    with torch.no_grad():
        want = hf_rows(transformers_reference(path), seqs, "causal")
    got = engine_rows(load_model(str(path)), seqs)
    assert_matches(got, want)
    # The stored weights are e4m3: the rows moved from the unquantized model's, as fp8 weights move them.
    cos = torch.nn.functional.cosine_similarity(got, plain_rows, dim=1)
    assert 0.9 < cos.min() and cos.max() < 0.999999


def write_fp8_layout(path, scale_name: str, block: int | None) -> None:
    """The folder's Linear weights of its layers in e4m3 with `scale_name` beside each (per output
    channel, or per block of block x block), as FBGEMM's and the fine-grained fp8 format store them."""
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if ".layers." in f".{n}" and n.endswith("proj.weight")]:
        w = tensors[name].float()
        if block:
            n, k = w.shape
            amax = w.abs().reshape(n // block, block, k // block, block).amax(dim=(1, 3))
            full = amax.repeat_interleave(block, 0).repeat_interleave(block, 1)
            tensors[name] = (w / (full / 448)).to(torch.float8_e4m3fn)
            tensors[name + scale_name[len("weight"):]] = amax / 448
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / 448
            tensors[name] = (w / scale).to(torch.float8_e4m3fn)
            tensors[name + scale_name[len("weight"):]] = scale
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("method, scale_name, block", [("fbgemm_fp8", "weight_scale", None),
                                                       ("fp8", "weight_scale_inv", 32)])
def test_fbgemm_and_fine_grained_fp8_folders_give_their_multiplied_out_rows(tmp_path, method, scale_name, block):
    path = tmp_path / "m"
    hf = make_tiny_qwen3(path)
    write_fp8_layout(path, scale_name, block)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, **({"weight_block_size": [block, block]} if block else {})}
    (path / "config.json").write_text(json.dumps(config))
    stored = load_file(str(path / "model.safetensors"))
    with torch.no_grad():  # the reference: transformers' model holding the stored values times their scales
        for name, p in hf.named_parameters():
            if stored[name].dtype == torch.float8_e4m3fn:
                s = stored[name + scale_name[len("weight"):]]
                if block:
                    s = s.repeat_interleave(block, 0).repeat_interleave(block, 1)
                p.copy_(stored[name].float() * s)
        seqs = random_seqs(LENGTHS)
        want = hf_rows(hf, seqs, "causal")
    assert_matches(engine_rows(load_model(str(path)), seqs), want)


def with_quantization_config(path, qc: dict) -> str:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "gptq", "bits": 4}, "weights quantized with gptq are not read"),
    ({"quant_method": "awq"}, "weights quantized with awq are not read"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "compressed-tensors format pack-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}}, "compressed-tensors format"),
])
def test_other_quantized_formats_are_refused_naming_them(tmp_path, qc, named):
    make_tiny_qwen3(tmp_path / "m")
    with pytest.raises(UnsupportedModel, match=named):
        read_model_spec(with_quantization_config(tmp_path / "m", qc))


def test_an_fp8_weight_without_its_scale_is_refused_naming_it(tmp_path):
    path = tmp_path / "m"
    make_tiny_qwen3(path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["layers.1.self_attn.o_proj.weight"] = tensors["layers.1.self_attn.o_proj.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with_quantization_config(path, {"quant_method": "fbgemm_fp8"})
    with pytest.raises(UnsupportedModel, match=r"layers\.1\.self_attn\.o_proj\.weight is stored in float8_e4m3fn "
                                               "with no layers.1.self_attn.o_proj.weight_scale"):
        load_model(str(path))


def test_fp8_products_equal_the_compressed_tensors_w8a8_forward(tmp_path):
    """An independent check of the fp8 products' numerics: transformers' model from an FP8_DYNAMIC
    folder, its quantization on, runs compressed-tensors' own W8A8 (e4m3 weights per channel,
    activations quantized per token as they arrive); pollen's model from the same folder with fp8
    products at every size (torch's references, float32) gives its rows. The norms stay unfolded
    so the products' weights are the stored ones."""
    from transformers import AutoModel

    from pollen.common.engine_options import EngineOptions
    from pollen.worker.models import fp8

    path = tmp_path / "m"
    make_tiny_qwen3(path)
    compressed_tensors_folder(path, "FP8_DYNAMIC")
    seqs = random_seqs(LENGTHS)
    with torch.no_grad():
        want = hf_rows(AutoModel.from_pretrained(str(path), dtype=torch.float32).eval(), seqs, "causal")
    model = load_model(str(path), options=EngineOptions(fold_norms=False, cpu_prepack=False))
    apart = torch.nn.functional.cosine_similarity(engine_rows(model, seqs), want, dim=1)
    assert apart.min() < 0.9999  # without fp8 products the activations are not quantized: the rows differ
    fp8.quantize_model(model, measure=False)
    assert_matches(engine_rows(model, seqs), want)


def test_an_fp8_scale_that_fits_no_layout_is_refused_naming_its_weight(tmp_path):
    path = tmp_path / "m"
    make_tiny_qwen3(path)
    write_fp8_layout(path, "weight_scale", None)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["layers.0.mlp.up_proj.weight_scale"] = torch.ones(5, 3)  # neither per channel nor per block
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with_quantization_config(path, {"quant_method": "fbgemm_fp8"})
    with pytest.raises(UnsupportedModel, match=r"tensor layers\.0\.mlp\.up_proj\.weight: a scale of shape \(5, 3\) "
                                               r"does not fit a weight of shape \(96, 64\)"):
        load_model(str(path))
