"""A ModernBERT config.json read as transformers (5.x) reads it: which layers attend globally,
the sliding window, the two RoPE bases, the norms and the MLP's activation.

Two spellings are on the Hub, and both mean the same model:
- the original: `global_attn_every_n_layers` (layer i is global when i % n == 0; default 3),
  `global_rope_theta` (default 160000) and `local_rope_theta` (default 10000);
- transformers 5's: `layer_types` ("full_attention" / "sliding_attention", one per layer) and
  `rope_parameters` {"full_attention": {...}, "sliding_attention": {...}}, whose `rope_theta`
  wins over the old keys; `rope_scaling` is merged into both.
A top-level `rope_theta` is not read (transformers ignores it for ModernBERT). `local_attention`
(default 128) is the whole window: a sliding layer's token sees the tokens at most
local_attention // 2 positions away on either side. `norm_eps` (default 1e-5) is the only epsilon
transformers reads; `layer_norm_eps`, which some sentence-transformers exports carry, is not.

No torch here: the frontend's model_spec checks a directory with it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYER_KINDS = ("full_attention", "sliding_attention")
# HF activation names -> F.gelu's `approximate`: "gelu" is the exact erf form.
GELU_FORMS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
_THETA_KEYS = {"full_attention": ("global_rope_theta", 160000.0), "sliding_attention": ("local_rope_theta", 10000.0)}


@dataclass(frozen=True, slots=True)
class ModernBertLayout:
    global_layers: tuple[bool, ...]  # per layer: attends to the whole sequence (else within the window)
    window: int  # a sliding layer's reach on either side of a token
    global_theta: float
    local_theta: float
    eps: float
    norm_bias: bool  # the LayerNorms' bias (ModernBERT's are biasless by default)
    attention_bias: bool  # Wqkv and the attention's Wo
    mlp_bias: bool  # Wi and the MLP's Wo
    gelu: str  # F.gelu's `approximate` for the GeGLU: "none" or "tanh"


def read_layout(config: dict) -> ModernBertLayout:
    """The layout of a ModernBERT config; ValueError names what we cannot serve (model_spec wraps it)."""
    layers = config["num_hidden_layers"]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    if config.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"head_dim {config['head_dim']} is not hidden_size / num_attention_heads ({hidden // heads})")
    act = config.get("hidden_activation", "gelu")
    if act not in GELU_FORMS:
        raise ValueError(f"hidden_activation {act!r} is not supported; supported: {sorted(GELU_FORMS)}")
    window = config.get("local_attention", 128)
    if type(window) is not int or window < 0:
        raise ValueError(f"local_attention must be a non-negative integer, got {window!r}")
    eps = config.get("norm_eps", 1e-5)
    if type(eps) not in (int, float) or not eps > 0:
        raise ValueError(f"norm_eps must be a positive number, got {eps!r}")
    thetas = _thetas(config)
    return ModernBertLayout(
        global_layers=tuple(kind == "full_attention" for kind in _layer_types(config, layers)),
        window=window // 2, global_theta=thetas["full_attention"], local_theta=thetas["sliding_attention"],
        eps=float(eps), norm_bias=_flag(config, "norm_bias"), attention_bias=_flag(config, "attention_bias"),
        mlp_bias=_flag(config, "mlp_bias"), gelu=GELU_FORMS[act])


def _layer_types(config: dict, layers: int) -> list[str]:
    kinds = config.get("layer_types")
    if kinds is None:
        every = config.get("global_attn_every_n_layers", 3)
        if type(every) is not int or every <= 0:
            raise ValueError(f"global_attn_every_n_layers must be a positive integer, got {every!r}")
        return ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or any(kind not in LAYER_KINDS for kind in kinds):
        raise ValueError(f"layer_types must list one of {LAYER_KINDS} for each of the {layers} layers")
    return kinds


def _thetas(config: dict) -> dict[str, float]:
    """Each layer kind's RoPE base; only the default RoPE (no scaling) is served."""
    given = config.get("rope_parameters") or {}
    if not isinstance(given, dict) or not set(given) <= set(LAYER_KINDS):
        raise ValueError(f"rope_parameters must map {LAYER_KINDS} to their RoPE settings, got {given!r}")
    scaling = config.get("rope_scaling") or {}
    thetas = {}
    for kind, (legacy, default) in _THETA_KEYS.items():
        params = {**(given.get(kind) or {}), **scaling}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"RoPE type {rope_type!r} is not supported (only the default)")
        theta = params["rope_theta"] if "rope_theta" in params else config.get(legacy, default)
        if type(theta) not in (int, float) or not theta > 0:
            raise ValueError(f"the {kind} layers' RoPE base must be a positive number, got {theta!r}")
        thetas[kind] = float(theta)
    return thetas


def _flag(config: dict, key: str) -> bool:
    value = config.get(key, False)
    if type(value) is not bool:
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value
