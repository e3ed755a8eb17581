"""Build an engine model from a HF safetensors directory (single file or sharded with an index),
with every kernel it runs chosen here, once (`choose_ops`)."""

from __future__ import annotations

import contextlib
import glob
import json
import os

import torch
from safetensors import safe_open

from pollen.common.engine_options import EngineOptions
from pollen.common.model_spec import SPARSE_TERMS, UnsupportedModel, read_config, read_model_spec
from pollen.worker import kernels
from pollen.worker.models.attention import backend as attention_backend
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.bert import BertEncoder
from pollen.worker.models.bge_m3 import load_head as load_bge_m3_head
from pollen.worker.models.checkpoint import FP8_DTYPES, SCALE_SUFFIXES, HeadTensor, dequantize, full_name
from pollen.worker.models.cpu_linear import prepack_linears
from pollen.worker.models.dense import load_dense
from pollen.worker.models.fp8 import quantize_model, unsupported_reason
from pollen.worker.models.gemma3 import Gemma3Encoder
from pollen.worker.models.modernbert import ModernBertEncoder
from pollen.worker.models.mpnet import MPNetEncoder
from pollen.worker.models.ops import Ops, reference_ops
from pollen.worker.models.qwen3 import Qwen3Encoder

FAMILIES: dict[str, type[EmbeddingModel]] = {"bert": BertEncoder, "gemma3": Gemma3Encoder,
                                             "modernbert": ModernBertEncoder, "mpnet": MPNetEncoder,
                                             "qwen3": Qwen3Encoder}


QUANTIZATIONS = ("none", "fp8")


def load_model(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               pooling: str | None = None, attention: str | None = None, task: str = "auto",
               options: EngineOptions = EngineOptions(), quantization: str = "none",
               sparse_max_terms: int = SPARSE_TERMS) -> EmbeddingModel:
    """The model in `path` on `device` in `dtype`, in eval mode, its kernels chosen from the device,
    dtype and `options` (the worker's WorkerConfig.engine_options), its head from `task` (--task:
    read_model_spec). quantization "fp8": its layers' products in e4m3 (worker/models/fp8.py;
    bfloat16 on a GPU that has fp8 products, else refused), what the load measured for it in
    `model.fp8_choice`."""
    spec = read_model_spec(path, pooling=pooling, attention=attention, task=task, sparse_max_terms=sparse_max_terms)
    check_quantization(path, quantization, torch.device(device), dtype)
    config = read_config(spec.path)
    ops = choose_ops(torch.device(device), dtype, options)
    # Build on the meta device: no random init of weights we overwrite anyway (matters for 4B models).
    with torch.device("meta"):
        model = FAMILIES[spec.family](spec, config, ops)
    model = model.to(dtype=dtype).to_empty(device=device)
    _load_weights(model, spec.path)
    model.after_load(options)
    if quantization == "fp8":  # sets model.fp8_choice
        quantize_model(model, min_tokens=options.fp8_min_tokens)
    model.dense_modules = load_dense(spec.dense, device)  # after the check that the map covers the parameters
    if spec.bge_m3:  # its heads are .pt files beside the safetensors ones
        model.output_head = load_bge_m3_head(spec.path, config["hidden_size"], device)
    model.eval()
    model.requires_grad_(False)
    if torch.device(device).type == "cpu" and options.cpu_prepack:
        prepack_linears(model)
    return model


def check_quantization(path: str, quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, in one line naming why, a quantization this device and dtype cannot run."""
    if quantization not in QUANTIZATIONS:
        raise UnsupportedModel(f"{path}: quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
    if quantization == "fp8":
        reason = unsupported_reason(device) or (None if dtype == torch.bfloat16 else
                                                f"it quantizes bfloat16 weights, and --dtype is {str(dtype)[6:]}")
        if reason:
            raise UnsupportedModel(f"{path}: --quantization fp8 is refused: {reason}")


def choose_ops(device: torch.device, dtype: torch.dtype, options: EngineOptions) -> Ops:
    """The implementations a model on `device` in `dtype` runs: the fused Triton kernels on CUDA
    when Triton is importable and options.triton is on, else the torch references; attention's
    kernel from the device, dtype and options.flash_attn (attention.backend)."""
    kind = attention_backend(device, dtype, options)
    if device.type == "cuda" and options.triton and kernels.available():
        from pollen.worker.kernels.fused import triton_ops  # imports Triton, which a CPU host may lack

        return triton_ops(kind, options)
    return reference_ops(kind)


def _load_weights(model: EmbeddingModel, path: str) -> None:
    files = _tensor_files(path)
    wanted = model.hf_weight_map()
    params = dict(model.named_parameters())
    if set(params) != set(wanted) or any(True for _ in model.buffers()):
        raise AssertionError(f"{type(model).__name__}.hf_weight_map does not cover its parameters. This is a bug.")

    # An MLM head, position_ids buffers etc. are simply never asked for.
    def found(prefix: str) -> int:
        return sum(full_name(n, prefix) in files for names in wanted.values() for n in names)

    prefix = max(model.hf_prefixes, key=found)
    missing = [full_name(n, prefix) for names in wanted.values() for n in names if full_name(n, prefix) not in files]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UnsupportedModel(f"{path}: checkpoint lacks {len(missing)} tensors: {shown}")

    with contextlib.ExitStack() as stack, torch.no_grad():
        handles = {}

        def handle(file: str):
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            return handles[file]

        def tensor(name: str | HeadTensor) -> torch.Tensor:
            stored = full_name(name, prefix)
            if isinstance(name, HeadTensor) and name.index is not None:
                return _row(handle(files[stored]), stored, name.index, path)
            t = handle(files[stored]).get_tensor(stored)
            return dequantized(t, stored) if t.dtype in FP8_DTYPES else t

        def dequantized(t: torch.Tensor, stored: str) -> torch.Tensor:
            """An fp8 weight times the scale stored beside it (common/stored_quantization.py)."""
            scale_name = next((stored + suffix for suffix in SCALE_SUFFIXES if stored + suffix in files), None)
            if scale_name is None:
                raise UnsupportedModel(f"{path}: tensor {stored} is stored in {str(t.dtype)[6:]} with no "
                                       f"{stored}_scale (or _scale_inv) beside it")
            try:
                return dequantize(t, handle(files[scale_name]).get_tensor(scale_name))
            except ValueError as exc:
                raise UnsupportedModel(f"{path}: tensor {stored}: {exc}") from None

        for ours, names in wanted.items():
            t = torch.cat([tensor(n) for n in names]) if len(names) > 1 else tensor(names[0])
            if t.shape != params[ours].shape:
                raise UnsupportedModel(
                    f"{path}: tensor {full_name(names[0], prefix)} has shape {tuple(t.shape)}, "
                    f"config.json implies {tuple(params[ours].shape)}"
                )
            params[ours].copy_(t)  # converts dtype and moves to the model's device


def _row(handle, name: str, index: int, path: str) -> torch.Tensor:
    """Row `index` of a stored tensor as [1, ...], read without the rest of it."""
    part = handle.get_slice(name)
    if not 0 <= index < part.get_shape()[0]:
        raise UnsupportedModel(f"{path}: tensor {name} has {part.get_shape()[0]} rows; row {index} was asked for")
    return part[index:index + 1]


def _tensor_files(path: str) -> dict[str, str]:
    """Checkpoint tensor name -> the .safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    files = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as h:
            files.update(dict.fromkeys(h.keys(), file))
    return files
