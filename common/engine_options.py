"""Switches of the engine's hot path, read once where the server starts and carried to each worker.

Every one is also a `pollen serve` flag and a POLLEN_* variable (`POLLEN_TRITON=0` is `--triton 0`,
server/config.py), hidden from `--help`: they exist to measure and debug the engine, and the
defaults are what serving wants. This module is their one description. The worker hands its
EngineOptions to `load_model` (worker/models/loader.py), which chooses every kernel once from
them and the device; nothing under worker/ reads the environment for them.

Benchmarks and tests build them directly: `EngineOptions(skinny=False)`, or
`EngineOptions.parse("skinny=0,triton=1")` from a command line.
"""
from __future__ import annotations

import dataclasses
import os

_SWITCH = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False, "no": False}


def parse_switch(value: str | bool) -> bool:
    """"1", "on", "true", "yes" -> True; "0", "off", "false", "no" -> False (any case)."""
    if isinstance(value, bool):
        return value
    try:
        return _SWITCH[value.strip().lower()]
    except KeyError:
        raise ValueError(f"expected 1/0 (or on/off, true/false, yes/no), got {value!r}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineOptions:
    triton: bool = True
    """Run the fused Triton kernels on CUDA (worker/kernels/; used only where Triton is importable):
    residual-add + RMSNorm, QK-norm + RoPE, SiLU-gate, the short-sequence attention and the query
    products. Off, CUDA runs the torch references of worker/models/ops.py, the same numbers to
    rounding: to tell a kernel's bug from the model's, or to measure what the kernels give."""

    short_attention: bool = True
    """With triton: sequences of up to 64 tokens take the register-resident attention kernel (for
    Qwen3 fused with its QK-norm and RoPE) instead of a flash-attention launch sized for long
    inputs. Off: every batch takes the varlen kernel (flash_attn or torch's): to compare the two."""

    skinny: bool = True
    """With triton: Qwen3 batches of up to 64 tokens take the five-kernel layer (the skinny
    products of worker/kernels/skinny.py, norms applied in their epilogues) instead of eight
    kernels. Off: queries take the general path: to measure or rule out the query kernels."""

    skinny_configs: str | None = None
    """A tile table written by worker/kernels/tune_skinny.py (its JSON), laid over the committed one
    (worker/kernels/skinny_configs.py): for a GPU other than the one that table was measured on."""

    flash_attn: bool = True
    """Use flash_attn's varlen kernel when that package is importable. Off: torch's own varlen_attn
    even then: to compare the two kernels, or to step around a flash_attn build that misbehaves."""

    fold_norms: bool = True
    """Qwen3: fold each pre-norm's weight into the product that reads it at load (the skinny
    products need it). Off: keep the checkpoint's weights, and with them the query kernels off:
    to compare numerics with the unfolded model."""

    cpu_prepack: bool = True
    """On the CPU: every product through oneDNN with its weight reordered once at load (and BERT's
    GELU in the same pass: worker/models/cpu_linear.py) instead of nn.Linear's sgemm, which repacks
    the weight on each call. Off: torch's nn.Linear: to measure what it gives."""

    cpu_pieces: bool = True
    """On the CPU: a batch of many texts is cut at sequence bounds into one piece per worker thread,
    and the pieces run at once, each on one thread (worker/cpu_engine.py, CpuEngine). Off: the whole
    batch on torch's intra-op pool (or one thread, as worker/thread_choice.py chooses): to measure
    what the pieces give."""

    onnx_spin: bool = False
    """On the CPU's ONNX Runtime engine: the intra-op pool's threads spin after each parallel region
    before they sleep (ONNX Runtime's own default). Off: they sleep at once, leaving the cores to
    the neighbours; a batch on the pool then wakes them for each region. To measure what spinning
    gives (load/bench_cpu.py, quiet and busy)."""

    fp8_min_tokens: int = 0
    """With --quantization fp8: the batch size (tokens) from which the fp8 products run, in place
    of the one measured at load (worker/models/fp8.py); 0: measured. To measure fp8 at sizes the
    measurement would leave on bfloat16, or to pin the choice while comparing runs."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "skinny_configs":
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"skinny_configs must be a path or None, got {value!r}")
            elif field.name == "fp8_min_tokens":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"fp8_min_tokens must be a token count (0: measured), got {value!r}")
            elif not isinstance(value, bool):
                raise ValueError(f"engine option {field.name} must be True or False, got {value!r}")
        if self.skinny_configs == "":
            object.__setattr__(self, "skinny_configs", None)  # an empty variable means none, as unset
        if self.skinny_configs is not None and not os.path.isfile(self.skinny_configs):
            raise ValueError(f"skinny_configs: no such file {self.skinny_configs!r}")

    @classmethod
    def parse(cls, text: str) -> EngineOptions:
        """From comma-separated NAME=VALUE pairs, e.g. "skinny=0,skinny_configs=/tmp/t.json"."""
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in names:
                raise ValueError(f"engine options are NAME=VALUE with NAME one of {sorted(names)}, got {item!r}")
            values[name] = value if name == "skinny_configs" else int(value) if name == "fp8_min_tokens" \
                else parse_switch(value)
        return cls(**values)

    def serve_flags(self) -> list[str]:
        """The `pollen serve` flags that give a server these options (the ones not at their default)."""
        flags = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != field.default:
                shown = str(int(value)) if isinstance(value, bool) else str(value)
                flags += ["--" + field.name.replace("_", "-"), shown]
        return flags
