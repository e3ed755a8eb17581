"""A Gemma3 text config.json (`gemma3_text`: EmbeddingGemma) read as transformers (5.x) reads it:
which layers slide, the window, each layer kind's RoPE, the attention scale and the MLP's
activation. Keys config.json leaves out take Gemma3TextConfig's defaults (head_dim 256,
query_pre_attn_scalar 256, sliding_window 4096, a sliding-window pattern of 6).

The window. With `use_bidirectional_attention` (EmbeddingGemma) transformers halves it: a sliding
layer's token sees the tokens at most sliding_window // 2 positions away on either side.
Without it the layers read causally, and a token sees itself and the sliding_window - 1 tokens
before it. `half_width` gives that reach for the attention actually served, so `--attention`
serves a checkpoint as transformers would with the flag flipped.

RoPE: `rope_parameters` keyed by layer kind (transformers 5's form) or the older top-level
`rope_theta` (full layers, default 1e6) with `rope_scaling` (full layers only) and
`rope_local_base_freq` (sliding layers, default 1e4).

No torch here: the frontend's model_spec checks a directory with it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from pollen.common.modernbert_config import GELU_FORMS, LAYER_KINDS

# Each layer kind's legacy RoPE-base key and Gemma3TextConfig's default for it.
_THETA_DEFAULTS = {"full_attention": ("rope_theta", 1_000_000.0),
                   "sliding_attention": ("rope_local_base_freq", 10_000.0)}


@dataclass(frozen=True, slots=True)
class Gemma3Layout:
    sliding_layers: tuple[bool, ...]  # per layer: attends within the window (else to the whole sequence)
    sliding_window: int  # config.json's value, before transformers halves it
    bidirectional: bool  # use_bidirectional_attention
    rope: dict  # layer kind -> its rope_parameters (rope_type, rope_theta, the kind's own keys)
    head_dim: int
    kv_heads: int
    query_pre_attn_scalar: float  # attention scores are scaled by its inverse square root
    eps: float
    attention_bias: bool  # q, k, v and o
    gelu: str  # F.gelu's `approximate` for the GeGLU: "none" or "tanh"

    def half_width(self, causal: bool) -> int:
        """A sliding layer's reach (worker/models/attention.py's window) for the attention served."""
        return self.sliding_window - 1 if causal else self.sliding_window // 2


def read_layout(config: dict) -> Gemma3Layout:
    """The layout of a gemma3_text config; ValueError names what we cannot serve (model_spec wraps it)."""
    for key in ("attn_logit_softcapping",):
        # Tanh-capped attention scores: no varlen kernel here takes a cap. (final_logit_softcapping
        # caps the language-model head's logits, which an embedder never computes: it is not read.)
        if config.get(key) is not None:
            raise ValueError(f"{key} {config[key]!r} is not supported (only null)")
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in GELU_FORMS:
        raise ValueError(f"hidden_activation {act!r} is not supported; supported: {sorted(GELU_FORMS)}")
    window = config.get("sliding_window", 4096)
    layers = _layer_types(config, config["num_hidden_layers"])
    if "sliding_attention" in layers and (type(window) is not int or window <= 0):
        raise ValueError(f"sliding_window must be a positive integer for sliding layers, got {window!r}")
    scalar = config.get("query_pre_attn_scalar", 256)
    eps = config.get("rms_norm_eps", 1e-6)
    for key, value in (("query_pre_attn_scalar", scalar), ("rms_norm_eps", eps)):
        if type(value) not in (int, float) or not value > 0:
            raise ValueError(f"{key} must be a positive number, got {value!r}")
    flags = {key: config.get(key) or False for key in ("use_bidirectional_attention", "attention_bias")}
    if any(type(value) is not bool for value in flags.values()):
        raise ValueError(f"use_bidirectional_attention and attention_bias must be true or false, got {flags}")
    return Gemma3Layout(
        sliding_layers=tuple(kind == "sliding_attention" for kind in layers), sliding_window=window or 0,
        bidirectional=flags["use_bidirectional_attention"], rope=_rope(config),
        head_dim=config.get("head_dim") or 256, kv_heads=config.get("num_key_value_heads") or 4,
        query_pre_attn_scalar=float(scalar), eps=float(eps), attention_bias=flags["attention_bias"],
        gelu=GELU_FORMS[act])


def _layer_types(config: dict, layers: int) -> list[str]:
    kinds = config.get("layer_types")
    if kinds is None:
        # transformers reads this key only (not the "_sliding_window_pattern" it writes beside layer_types).
        every = config.get("sliding_window_pattern", 6)
        if type(every) is not int or every <= 0:
            raise ValueError(f"sliding_window_pattern must be a positive integer, got {every!r}")
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or any(kind not in LAYER_KINDS for kind in kinds):
        raise ValueError(f"layer_types must list one of {LAYER_KINDS} for each of the {layers} layers")
    return kinds


def _rope(config: dict) -> dict:
    """Each layer kind's RoPE settings (model_spec checks their kinds and keys)."""
    given = config.get("rope_parameters") or {}
    if not isinstance(given, dict) or not set(given) <= set(LAYER_KINDS):
        raise ValueError(f"rope_parameters must map {LAYER_KINDS} to their RoPE settings, got {given!r}")
    rope = {}
    for kind, (legacy, default) in _THETA_DEFAULTS.items():
        params = dict(given.get(kind) or {})
        if kind == "full_attention":  # as transformers merges it, over either form
            params.update(config.get("rope_scaling") or {})
        params.setdefault("rope_type", params.pop("type", "default"))
        params.setdefault("rope_theta", config.get(legacy, default))
        rope[kind] = params
    return rope
