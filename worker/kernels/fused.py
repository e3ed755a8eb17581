"""The Triton kernels as one model's `Ops` (worker/models/ops.py).

Importing this module imports Triton: the loader does it only for a CUDA model whose
EngineOptions want the kernels (worker/models/loader.py, `choose_ops`).
"""
from __future__ import annotations

from pollen.common.engine_options import EngineOptions
from pollen.worker.kernels import activations, norms, quant, relative_attention, rope, short_attention, skinny
from pollen.worker.models.ops import Ops


def triton_ops(attention: str, options: EngineOptions) -> Ops:
    """The fused kernels, with the attention kernel `attention`; the short-sequence attention and
    the query products as options.short_attention and options.skinny say; MPNet's relative-bias
    attention always (it has no other graph-safe form)."""
    if options.skinny_configs:  # a locally tuned table, over the committed one
        skinny.load_configs(options.skinny_configs)
    short, query = options.short_attention, options.skinny
    return Ops("triton", attention, norms.add_rms_norm, norms.embed_rms_norm, rope.qk_norm_rope,
               activations.silu_mul, activations.gelu_mul,
               short_attention=short_attention.short_attention if short else None,
               short_qk_rope_attention=short_attention.short_qk_rope_attention if short else None,
               skinny_linear=skinny.skinny_linear if query else None,
               skinny_fits=skinny.fits if query else None,
               skinny_layer_wins=skinny.layer_wins if query else None,
               relative_attention=relative_attention.relative_attention,
               quantize_rows=quant.quantize_rows, add_rms_norm_fp8=norms.add_rms_norm_fp8,
               embed_rms_norm_fp8=norms.embed_rms_norm_fp8, silu_mul_fp8=quant.silu_mul_fp8)
