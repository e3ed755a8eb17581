"""fp8 products (`pollen serve --quantization fp8`): each encoder layer's matrix products in e4m3.

A weight is quantized once at load, per output channel: scale[n] = max|W[n, :]| / 448 (e4m3's
largest value), W8 = W / scale. An activation is quantized per token as it is made: each row's own
scale, so one outlier token never flattens the others. The product is torch._scaled_mm with both
scales, its output bfloat16; attention, the norms, the embeddings and pooling stay bfloat16.

The layers' nn.Linear modules become Fp8Linear, which keep the checkpoint's weight beside the fp8
one: a batch under `min_tokens` runs the bfloat16 product. At a few rows the product reads its
weight once and is bound by memory; fp8 halves the weight's bytes, but the activation's
quantization and the scaled product's fixed costs can outweigh that, the more on a small model.
`measure_min_tokens` times both on the first layer's products at load, each replayed from a CUDA
graph as the engine runs them, and chooses; where fp8 never wins, the model keeps bfloat16 and no
fp8 weight. EngineOptions.fp8_min_tokens sets the size instead (for measuring). The CUDA engine
moves the size to just past one of its graph buckets (`align`), so that a batch takes the same
products eagerly (its own token count) and in its bucket's graph (padded).

Where a model's forward knows the kernel that makes a product's input (Qwen3's residual-add +
RMSNorm, its SiLU-gate), that kernel writes the fp8 row and its scale in the same pass
(worker/kernels/quant.py, Ops.*_fp8) and calls `Fp8Linear.scaled`; any other input goes through
`Fp8Linear.forward`, which quantizes it in one pass of its own (Ops.quantize_rows).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pollen.worker.models.ops import AMAX_FLOOR, E4M3, E4M3_MAX

# _scaled_mm needs both dimensions of the weight to be multiples of 16 (cuBLASLt's fp8 alignment).
ALIGN = 16
# Token counts measured at load (the CUDA engine's graph buckets lie between them).
MEASURED_TOKENS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
NEVER = 1 << 62  # min_tokens where fp8 never runs


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 [N]): per output channel, scale = max|row| / 448."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(AMAX_FLOOR) / E4M3_MAX
    return (w / scale[:, None]).to(E4M3), scale


def fits(linear: nn.Linear) -> bool:
    """Whether _scaled_mm takes this product's shape."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


class Fp8Linear(nn.Module):
    """nn.Linear with an e4m3 copy of its weight: x @ W.T + b in fp8 from `min_tokens` rows on,
    in the checkpoint's dtype below. Its `weight` and `bias` are the original ones (the query
    kernels and the bfloat16 buckets read them)."""

    def __init__(self, linear: nn.Linear, quantize: Callable, name: str = ""):
        super().__init__()
        self.in_features, self.out_features, self.name = linear.in_features, linear.out_features, name
        self.weight, self.bias = linear.weight, linear.bias
        object.__setattr__(self, "original", linear)  # not a submodule: its weight is this one's
        w8, scale = quantize_weight(linear.weight.detach())
        self.register_buffer("weight_fp8", w8, persistent=False)
        self.register_buffer("weight_scale", scale[None, :].contiguous(), persistent=False)
        self.quantize = quantize  # Ops.quantize_rows: x -> (e4m3 x, scale [T, 1])
        self.min_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] < self.min_tokens:
            return F.linear(x, self.weight, self.bias)
        return self.scaled(*self.quantize(rows)).reshape(*shape[:-1], self.out_features)

    def scaled(self, x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The product of an already quantized input (e4m3 [T, K], float32 [T, 1]), bfloat16 [T, N]."""
        out = torch._scaled_mm(x8, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                               out_dtype=self.weight.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, min_tokens={self.min_tokens}"


def quantize_layers(layers: nn.Module, quantize: Callable) -> list[Fp8Linear]:
    """Swap every nn.Linear under `layers` (a model's encoder layers; its embeddings, head and Dense
    modules stay as they are) whose shape _scaled_mm takes for an Fp8Linear; the new modules."""
    swapped = []
    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and fits(child):
                fp8 = Fp8Linear(child, quantize, name)
                setattr(parent, name, fp8)
                swapped.append(fp8)
    return swapped


def unquantize_layers(layers: nn.Module) -> None:
    """Put each Fp8Linear under `layers` back to the nn.Linear it was made from."""
    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Fp8Linear):
                setattr(parent, name, child.original)


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """What measure_min_tokens found: fp8 from `min_tokens` rows on; per measured row count, the
    bfloat16 and the fp8 time (seconds) of one layer's products, the fp8 ones with their inputs'
    quantization."""

    min_tokens: int
    timings: tuple[tuple[int, float, float], ...]

    def describe(self) -> str:
        where = ("never (bfloat16 throughout)" if self.min_tokens >= NEVER else
                 f"from {self.min_tokens} tokens a batch")
        if not self.timings:
            return f"fp8 products {where} (as set)"
        ratios = ", ".join(f"{t}: {f / b:.2f}" for t, b, f in self.timings)
        return f"fp8 products {where}; fp8/bfloat16 time of one layer's products by tokens: {ratios}"


def measure_min_tokens(linears: list[Fp8Linear], fused: tuple[str, ...] = (), repeats: int = 20) -> Choice:
    """Time one layer's products (`linears`, in their order) at each of MEASURED_TOKENS rows in
    bfloat16 and in fp8, each replayed from a CUDA graph, on their device; fp8 from the smallest
    count at and above which it is faster at every count measured. A product named in `fused`
    gets its input quantized already (the model's own kernel made it so: Ops.*_fp8); any other
    pays its quantization pass."""
    device = linears[0].weight.device
    timings = []
    with torch.inference_mode():
        for tokens in MEASURED_TOKENS:
            inputs = [torch.randn(tokens, lin.in_features, device=device, dtype=lin.weight.dtype) for lin in linears]
            ready = [lin.quantize(x) if lin.name in fused else None for lin, x in zip(linears, inputs)]

            def bf16():
                for lin, x in zip(linears, inputs):
                    F.linear(x, lin.weight, lin.bias)

            def fp8():
                for lin, x, q in zip(linears, inputs, ready):
                    lin.scaled(*(q or lin.quantize(x)))

            timings.append((tokens, _seconds(bf16, repeats), _seconds(fp8, repeats)))
    return Choice(min_tokens_from(timings), tuple(timings))


def min_tokens_from(timings: list[tuple[int, float, float]]) -> int:
    """From (tokens, bfloat16 s, fp8 s) in rising tokens: the smallest count from which fp8 was
    faster at every count measured; NEVER where it was not faster at the last."""
    min_tokens = NEVER
    for tokens, b, f in reversed(timings):
        if f >= b:
            break
        min_tokens = tokens
    return min_tokens


def align(model: nn.Module, buckets: list[int]) -> None:
    """Move the model's fp8 threshold to one past the largest of the engine's graph `buckets`
    under it (every batch of a bucket then takes the same products, eager or in the graph)."""
    choice = getattr(model, "fp8_choice", None)
    if choice is None or choice.min_tokens >= NEVER:
        return
    below = [b for b in buckets if b < choice.min_tokens]
    set_min_tokens(model, below[-1] + 1 if below else 0)


def same_products(model: nn.Module, tokens: int, padded: int) -> bool:
    """Whether a batch of `tokens` run padded to `padded` takes the same products (the CUDA
    engine's covering graphs)."""
    choice = getattr(model, "fp8_choice", None)
    return choice is None or (tokens >= choice.min_tokens) == (padded >= choice.min_tokens)


def set_min_tokens(model: nn.Module, min_tokens: int) -> None:
    """fp8 products from `min_tokens` tokens a batch on, in every Fp8Linear and in the model's own
    fused forward (EmbeddingModel.after_quantize)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.min_tokens = min_tokens
    model.after_quantize(min_tokens)
    model.fp8_choice = dataclasses.replace(model.fp8_choice, min_tokens=min_tokens)


def _seconds(fn: Callable[[], None], repeats: int) -> float:
    """The median seconds of one replay of `fn` captured in a CUDA graph (as the engine runs a
    batch: no launch costs), after a warm-up call that compiles what it needs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del graph
    times.sort()
    return times[len(times) // 2]


def quantize_model(model: nn.Module, measure: bool = True, min_tokens: int = 0) -> Choice:
    """Put `model`'s encoder layers (its `layers`) on fp8 products with the quantization of its
    Ops, from the batch size `min_tokens` gives (0: measure_min_tokens on the first layer; with
    `measure` False, every size: for a CPU test of the numerics). Where fp8 never wins, the
    layers stay as they were. The model hears of the choice (EmbeddingModel.after_quantize), so
    its own fused fp8 forward follows it; `model.fp8_choice` keeps it."""
    quantize = model.ops.quantize_rows
    first = quantize_layers(model.layers[0], quantize)
    if not first:
        raise ValueError("no product of this model's layers has a shape fp8 products take (multiples of 16)")
    if min_tokens:
        choice = Choice(min_tokens, ())
    else:
        choice = measure_min_tokens(first, model.fp8_fused) if measure else Choice(0, ())
        if measure:
            torch.cuda.empty_cache()  # the measurement's graph pools and inputs: the model's memory figure is its own
    model.fp8_choice = choice
    if choice.min_tokens >= NEVER:
        unquantize_layers(model.layers[0])
        return choice
    for layer in model.layers[1:]:
        quantize_layers(layer, quantize)
    set_min_tokens(model, choice.min_tokens)
    return model.fp8_choice


def unsupported_reason(device: torch.device) -> str | None:
    """Why fp8 products cannot run on `device` (None: they can): a CPU, or a GPU before compute
    capability 8.9 (Ada and Hopper have e4m3 tensor cores)."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU with fp8 tensor cores (compute capability 8.9 or later), not the {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"{name} has compute capability {major}.{minor}; fp8 products need 8.9 or later "
                "(Ada, Hopper, Blackwell)")
    return None
