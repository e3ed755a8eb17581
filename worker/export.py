"""`python -m pollen.worker.export '[{"model": DIR, "out": FOLDER, "task": T}, ...]'`: each model's
ONNX files for the CPU's ONNX Runtime engine (worker/onnx_engine.py), written into its folder. The
supervisor runs it for the checkpoints its cache lacks, all in one process of their own (it
imports torch; the worker that serves the files need not), and keeps what it writes
(common/onnx_cache.py).

What is exported is pollen's own model code (worker/models/), loaded as the torch engine loads it
(float32, products as plain nn.Linear), run on a right-padded batch:

    encoder.onnx  input_ids [n, L] int32, lengths [n] int32 (each row's tokens, from the left)
                  -> hidden [n, L, hidden] float32 (the last layer's states; a pad's are garbage)
    head.onnx     pooled [R, hidden] float32 -> rows [R, output_dims] float32
                  (only for a model with a head or Dense modules: EmbeddingModel.head)

Each layer's attention is ONNX Runtime's fused Attention (com.microsoft): one op for the q/k/v
product, the scores, each row's padding masked, the softmax and the values, with MPNet's
relative-position bias as its attention_bias input. ONNX Runtime's graph optimizer finds no
attention in a plain export of our fused q/k/v product, and op by op that attention costs more
than the rest of the layer. The embedding and the layer past its attention are the model's own
code (`embed`, BertLayer.after_attention); the optimizer fuses their LayerNorms, GELUs and bias
additions at load. Pooling is not in the graph: the engine pools the padded output over any row
spans (worker/padded.py), so one export serves every pooling and request kind.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from pollen.common.engine_options import EngineOptions
from pollen.common.onnx_cache import ENCODER_FILE, HEAD_FILE, OPSET
from pollen.worker.models.base import EmbeddingModel
from pollen.worker.models.loader import load_model
from pollen.worker.models.mpnet import MPNetEncoder
from pollen.worker.models.relative_position import sequence_bias


class FusedAttention(torch.autograd.Function):
    """ONNX Runtime's Attention op: x [n, L, hidden], weight [hidden, 3 hidden] (q, k, v side by
    side), bias [3 hidden], lengths [n] int32, optional position bias [1, heads, L, L] -> [n, L, hidden].
    Run eagerly (while the export traces), SDPA computes the same."""

    @staticmethod
    def forward(ctx, x, weight, bias, lengths, heads: int, position_bias):
        n, length, hidden = x.shape
        q, k, v = (x @ weight + bias).view(n, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
        padding = torch.arange(length) >= lengths[:, None]
        mask = torch.zeros(n, 1, 1, length).masked_fill(padding[:, None, None, :], float("-inf"))
        if position_bias is not None:
            mask = mask + position_bias
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(n, length, hidden)

    @staticmethod
    def symbolic(g, x, weight, bias, lengths, heads: int, position_bias):
        inputs = [x, weight, bias, lengths]
        if position_bias is not None:  # after an omitted `past` input
            inputs += [g.op("prim::Constant").setType(torch._C.OptionalType.ofTensor()), position_bias]
        out = g.op("com.microsoft::Attention", *inputs, num_heads_i=heads)
        return out.setType(x.type())


class PaddedEncoder(nn.Module):
    """The model's layers on a right-padded batch (the module docstring's encoder.onnx)."""

    def __init__(self, model: EmbeddingModel):
        super().__init__()
        self.model = model
        # The Attention op takes the q/k/v product as [in, out]; nn.Linear keeps [out, in].
        self.qkv = nn.ParameterList(nn.Parameter(layer.qkv.weight.t().contiguous(), requires_grad=False)
                                    for layer in model.layers)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        model, length = self.model, input_ids.shape[1]
        x = model.embed(input_ids, torch.arange(length, dtype=torch.int32))
        bias = None
        if isinstance(model, MPNetEncoder):
            bias = sequence_bias(model.attention.table, length).unsqueeze(0)
        for layer, weight in zip(model.layers, self.qkv):
            attended = FusedAttention.apply(x, weight, layer.qkv.bias, lengths, layer.heads, bias)
            x = layer.after_attention(x, attended)
        return model.last(x)


class Head(nn.Module):
    """Pooled rows through the model's head or Dense modules (EmbeddingModel.head)."""

    def __init__(self, model: EmbeddingModel):
        super().__init__()
        self.model = model

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.model.head(pooled)


def export(path: str, out: str, task: str = "auto") -> None:
    """The model in `path`, served with `task`, as encoder.onnx (and head.onnx) in the folder `out`."""
    model = load_model(path, task=task, options=EngineOptions(cpu_prepack=False))
    encoder = PaddedEncoder(model).eval()
    ids = torch.randint(1, 100, (2, 11), dtype=torch.int32)
    lengths = torch.tensor([11, 7], dtype=torch.int32)
    _save(encoder, (ids, lengths), out, ENCODER_FILE, ["input_ids", "lengths"], "hidden",
          {"input_ids": {0: "n", 1: "length"}, "lengths": {0: "n"}, "hidden": {0: "n", 1: "length"}})
    if model.output_head is not None or model.dense_modules is not None:
        with torch.no_grad():
            width = encoder(ids, lengths).shape[-1]  # what pooling hands the head
        _save(Head(model).eval(), (torch.randn(3, width),), out, HEAD_FILE, ["pooled"], "rows",
              {"pooled": {0: "rows"}, "rows": {0: "rows"}})


def _save(module: nn.Module, args: tuple, out: str, name: str, inputs: list[str], output: str, axes: dict) -> None:
    """torch.onnx's TorchScript exporter into a folder of its own, then the graph saved as `name` in
    `out` with every weight in one data file beside it (name.data): past protobuf's 2 GB the
    exporter would leave a file per tensor."""
    import onnx

    raw = os.path.join(out, "raw")
    os.mkdir(raw)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes on Python values it keeps as constants
        torch.onnx.export(module, args, os.path.join(raw, name), dynamo=False, input_names=inputs,
                          output_names=[output], opset_version=OPSET, dynamic_axes=axes,
                          custom_opsets={"com.microsoft": 1})
    graph = onnx.load(os.path.join(raw, name))
    shutil.rmtree(raw)
    onnx.save_model(graph, os.path.join(out, name), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=name + ".data", size_threshold=1024)
    onnx.checker.check_model(os.path.join(out, name))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # tracing small batches: a pool would only compete with the server's start
    for job in json.loads(argv[0]):  # one line on stdout for each, in order: {"error": why or null}
        try:
            export(job["model"], job["out"], job.get("task", "auto"))
            error = None
        except Exception as exc:  # noqa: BLE001 - any failure is this model's, said in its line
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(json.dumps({"model": job["model"], "error": error}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
