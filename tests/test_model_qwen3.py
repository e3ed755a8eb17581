"""Our packed Qwen3 (both modes) against HF transformers' Qwen3Model on tiny random checkpoints.

Causal mode is Qwen3-Embedding (last-token pooling); bidirectional mode is pplx-embed-v1
(`bidirectional_pplx_qwen3`, mean pooling). For the bidirectional reference, HF gets an all-true
4-D attention mask, which replaces its causal mask. HF code is the reference, never the engine.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json

import numpy as np
import pytest
import torch

from pollen.common.engine_options import EngineOptions
from pollen.common.model_spec import UnsupportedModel, read_model_spec
from pollen.worker.eager_engine import EagerEngine
from pollen.worker.models import ops
from pollen.worker.models.loader import load_model
from pollen.worker.models.ops import reference_ops
from pollen.worker.packed import pack

LENGTHS = [1, 9, 2, 40, 64, 13]


def make_tiny_qwen3(path, mode="causal", max_shard_size=None, bias=False, seed=0, **sizes):
    """Save a tiny random Qwen3 checkpoint; return the HF model to compare against.

    Norm weights are randomized too (HF initializes them to ones, which would hide a swapped or
    missing norm). mode "bidirectional" rewrites model_type to pplx-embed's.
    """
    import transformers as tf

    torch.manual_seed(seed)
    shape = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=64)
    config = tf.Qwen3Config(**{**shape, **sizes}, rope_theta=5000.0, attention_bias=bias)
    model = tf.Qwen3Model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    if mode == "bidirectional":
        cfg = json.loads((path / "config.json").read_text())
        cfg["model_type"] = "bidirectional_pplx_qwen3"
        cfg["architectures"] = ["PPLXQwen3Model"]
        (path / "config.json").write_text(json.dumps(cfg))
    return model


@torch.no_grad()
def hf_rows(model, seqs, mode):
    out = []
    for s in seqs:
        n = len(s)
        if mode == "causal":
            out.append(model(input_ids=s[None]).last_hidden_state[0, -1])
        else:
            mask = torch.ones(1, 1, n, n, dtype=torch.bool)  # everyone sees everyone
            out.append(model(input_ids=s[None], attention_mask=mask).last_hidden_state[0].mean(0))
    return torch.stack(out)


def random_seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g) for n in lengths]


def engine_rows(model, seqs):
    batch = pack([s.numpy().astype(np.int32) for s in seqs])
    return torch.from_numpy(EagerEngine(model).submit(batch).result())


def assert_matches(ours, ref, cos_min=0.99999, atol=1e-4):
    cos = torch.nn.functional.cosine_similarity(ours, ref.float(), dim=1).min().item()
    diff = (ours - ref).abs().max().item()
    assert cos >= cos_min and diff < atol, f"min cosine {cos}, max abs diff {diff}"


@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_tiny_qwen3_matches_hf(tmp_path, mode):
    hf = make_tiny_qwen3(tmp_path / "m", mode)
    spec = read_model_spec(str(tmp_path / "m"))
    assert spec.family == "qwen3" and spec.causal == (mode == "causal")
    assert spec.pooling == ("last" if mode == "causal" else "mean")
    model = load_model(str(tmp_path / "m"))
    seqs = random_seqs(LENGTHS)
    assert_matches(engine_rows(model, seqs), hf_rows(hf, seqs, mode))


def test_sharded_checkpoint_with_bias_and_prefix(tmp_path):
    """Sharded files, attention biases, and a CausalLM-style "model." prefix all load."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    hf = make_tiny_qwen3(tmp_path / "m", "causal", max_shard_size="100KB", bias=True)
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    seqs = random_seqs(LENGTHS, seed=2)
    ref = hf_rows(hf, seqs, "causal")
    assert_matches(engine_rows(load_model(str(tmp_path / "m")), seqs), ref)

    # The same weights under "model." (how Qwen3ForCausalLM saves them) in one file.
    (tmp_path / "p").mkdir()
    tensors = {}
    for f in (tmp_path / "m").glob("*.safetensors"):
        tensors.update({"model." + k: v for k, v in load_file(str(f)).items()})
    save_file(tensors, str(tmp_path / "p" / "model.safetensors"))
    (tmp_path / "p" / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    assert_matches(engine_rows(load_model(str(tmp_path / "p")), seqs), ref)
    del tf


def test_flags_override_attention_and_pooling(tmp_path):
    """A bidirectional checkpoint read causally with last-token pooling equals HF's causal run."""
    hf = make_tiny_qwen3(tmp_path / "m", "bidirectional")
    model = load_model(str(tmp_path / "m"), pooling="last", attention="causal")
    assert model.spec.causal and model.spec.pooling == "last"
    seqs = random_seqs(LENGTHS, seed=3)
    assert_matches(engine_rows(model, seqs), hf_rows(hf, seqs, "causal"))
    with pytest.raises(UnsupportedModel, match="attention"):
        read_model_spec(str(tmp_path / "m"), attention="sideways")


def test_bf16_close_to_fp32_reference(tmp_path):
    hf = make_tiny_qwen3(tmp_path / "m", "bidirectional")
    seqs = random_seqs(LENGTHS, seed=4)
    ours = engine_rows(load_model(str(tmp_path / "m"), dtype=torch.bfloat16), seqs)
    assert_matches(ours, hf_rows(hf, seqs, "bidirectional"), cos_min=0.999, atol=1.0)


def test_unsupported_qwen3_configs_are_named(tmp_path):
    make_tiny_qwen3(tmp_path / "m")
    cfg_file = tmp_path / "m" / "config.json"
    base = json.loads(cfg_file.read_text())
    for change, message in [({"use_sliding_window": True}, "sliding"),
                            ({"hidden_act": "gelu"}, "hidden_act"),
                            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "RoPE"),
                            ({"num_key_value_heads": 3}, "num_key_value_heads")]:
        cfg_file.write_text(json.dumps({**base, **change}))
        with pytest.raises(UnsupportedModel, match=message):
            read_model_spec(str(tmp_path / "m"))


def test_reference_ops_match_hf_pieces():
    """Our RoPE (halves form, float32 cache) equals HF's rotate_half formulation."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    torch.manual_seed(0)
    heads, kv, d, t = 4, 2, 16, 11
    qkv = torch.randn(t, (heads + 2 * kv) * d)
    pos = torch.arange(t)
    cache = ops.rope_cache(10000.0, d, 64, "cpu")
    ones = torch.ones(d)
    q, k, v = ops.qk_norm_rope(qkv, ones, ones, cache, pos, heads, kv, 1e-6)
    q0, k0, v0 = qkv.view(t, heads + 2 * kv, d).split([heads, kv, kv], dim=1)
    q0, k0 = ops.rms_norm(q0, ones, 1e-6), ops.rms_norm(k0, ones, 1e-6)
    cos, sin = cache[pos].chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    qr, kr = apply_rotary_pos_emb(q0.transpose(0, 1)[None], k0.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q, qr[0].transpose(0, 1))
    torch.testing.assert_close(k, kr[0].transpose(0, 1))
    assert torch.equal(v, v0)


def test_folding_the_norms_changes_weights_not_results(tmp_path):
    """after_load folds each pre-norm's weight into the product that reads it; fold_norms=False
    keeps the checkpoint's weights. Both give the same embeddings (float32)."""
    make_tiny_qwen3(tmp_path / "m", "causal")
    seqs = [torch.randint(0, 1000, (n,), dtype=torch.int32) for n in (5, 17, 2)]
    cu = torch.tensor([0, 5, 22, 24], dtype=torch.int32)
    out = {}
    for fold in (True, False):
        model = load_model(str(tmp_path / "m"), options=EngineOptions(fold_norms=fold))
        assert model.folded == fold
        assert torch.all(model.layers[0].attn_norm.weight == 1) == fold
        with torch.no_grad():
            out[fold] = model(torch.cat(seqs), cu, 17)
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)


def test_the_cpu_takes_the_torch_references_whatever_the_options(tmp_path):
    """Kernels are chosen at load: on the CPU, the torch references and the SDPA loop, with no
    short-attention or query kernels; none of our Triton modules is imported (a fresh process)."""
    import subprocess
    import sys

    make_tiny_qwen3(tmp_path / "m", "causal")
    for options in (EngineOptions(), EngineOptions(triton=False, flash_attn=False)):
        model = load_model(str(tmp_path / "m"), options=options)
        assert model.ops == reference_ops("sdpa_loop")
        assert (model.ops.add_rms_norm, model.ops.qk_norm_rope) == (ops.add_rms_norm, ops.qk_norm_rope)
        assert model.attention.kind == "sdpa_loop" and model.attention.short is None
        assert model.short_qk_rope_attention is None and not model.query_kernels
    code = ("import sys, torch\nfrom pollen.worker.models.loader import load_model\n"
            f"load_model({str(tmp_path / 'm')!r})(torch.arange(5), torch.tensor([0, 5], dtype=torch.int32), 5)\n"
            "assert not [m for m in sys.modules if m.startswith('pollen.worker.kernels.')], sorted(sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_kernels_are_chosen_at_load_from_device_dtype_and_options(tmp_path, monkeypatch):
    """choose_ops picks every implementation once; checked here for CUDA without a GPU (nothing runs).
    Each option turns off exactly its kernels in the model that load_model builds."""
    from pollen.worker import kernels
    from pollen.worker.models import attention, loader

    cuda = torch.device("cuda")
    assert loader.choose_ops(torch.device("cpu"), torch.bfloat16, EngineOptions()) == reference_ops("sdpa_loop")
    with monkeypatch.context() as m:
        m.setattr(kernels, "available", lambda: False)  # a CUDA host without Triton
        assert loader.choose_ops(cuda, torch.bfloat16, EngineOptions()).name == "torch"
    varlen = "flash_attn" if attention._flash_varlen is not None else "torch_varlen"
    assert attention.backend(cuda, torch.bfloat16, EngineOptions()) == varlen
    assert attention.backend(cuda, torch.bfloat16, EngineOptions(flash_attn=False)) == "torch_varlen"
    assert attention.backend(cuda, torch.float32, EngineOptions()) == "sdpa_loop"
    assert loader.choose_ops(cuda, torch.bfloat16, EngineOptions(triton=False)) == reference_ops(varlen)

    pytest.importorskip("triton")
    make_tiny_qwen3(tmp_path / "m", "causal", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, intermediate_size=512, num_hidden_layers=2, max_position_embeddings=256)
    real = loader.choose_ops
    monkeypatch.setattr(loader, "choose_ops", lambda device, dtype, options: real(cuda, dtype, options))
    for options in (EngineOptions(), EngineOptions(short_attention=False), EngineOptions(skinny=False),
                    EngineOptions(fold_norms=False), EngineOptions(triton=False)):
        model = load_model(str(tmp_path / "m"), dtype=torch.bfloat16, options=options)
        short = options.triton and options.short_attention
        assert model.ops.name == ("triton" if options.triton else "torch")
        assert model.attention.kind == varlen and (model.attention.short is not None) == short
        assert (model.short_qk_rope_attention is not None) == short
        assert model.query_kernels == (options.triton and options.skinny and options.fold_norms)
        assert model.fits_query_kernels(64) == model.query_kernels and not model.fits_query_kernels(65)
    fp32 = load_model(str(tmp_path / "m"), dtype=torch.float32)
    assert fp32.attention.kind == "sdpa_loop" and fp32.attention.short is None  # the loop takes no short kernel
    assert fp32.short_qk_rope_attention is not None and not fp32.fits_query_kernels(16)
