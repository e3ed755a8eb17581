"""Checkpoints whose weights are stored quantized: the fp8 formats pollen reads, and a one-line
refusal of the rest at start.

Read: weights stored as float8 (e4m3 or e5m2) with a scale tensor beside each, the formats
llm-compressor and transformers write:
- compressed-tensors, format "float-quantized" (e.g. the FP8_DYNAMIC and FP8_BLOCK schemes):
  `x.weight` and `x.weight_scale`, one scale per tensor, per output channel or per block;
- "fbgemm_fp8": `x.weight` and `x.weight_scale`, per output channel;
- "fp8" (transformers' fine-grained fp8, as Qwen's and DeepSeek's FP8 releases ship):
  `x.weight` and `x.weight_scale_inv`, one per 128 x 128 block (the name notwithstanding, the
  factor the stored values are multiplied by).
The loader multiplies each back out into the model's dtype (worker/models/checkpoint.py
dequantize), so every path runs as from a bf16 checkpoint holding those values, and
`--quantization fp8` quantizes them again per output channel for fp8 products. Stored activation
scales (static input scales) are not read: activations are quantized per token from their own
values.
"""
from __future__ import annotations

FP8_METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")


def stored_quantization(config: dict) -> str:
    """The checkpoint's quant_method (config.json's quantization_config) where it is one pollen
    reads, "" for plain weights; ValueError naming any other."""
    spec = config.get("quantization_config") or config.get("compression_config")
    if not spec:
        return ""
    method = spec.get("quant_method", "")
    if method == "compressed-tensors":
        groups = (spec.get("config_groups") or {}).values()
        formats = {spec.get("format")} | {group.get("format") for group in groups}
        formats.discard(None)
        weights = [group.get("weights") or {} for group in groups]
        if formats <= {"float-quantized", "dense"} and all(w.get("type") == "float" and w.get("num_bits") == 8
                                                  for w in weights):
            return method
        shown = ", ".join(sorted(map(str, formats))) or "its"
        raise ValueError(f"compressed-tensors format {shown} is not read (pollen reads fp8 weights, "
                               "format float-quantized); serve the unquantized checkpoint")
    if method in FP8_METHODS:
        return method
    raise ValueError(f"weights quantized with {method or 'an unnamed method'} are not read (pollen reads "
                           f"bf16, fp16 and fp32 weights, and fp8 ones stored as {', '.join(FP8_METHODS)}); serve "
                           "the unquantized checkpoint, with --quantization fp8 for fp8 products")
