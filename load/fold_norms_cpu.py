"""Does folding the RMSNorm weights into the next products (Qwen3Encoder.after_load) cost bf16
accuracy? On the CPU, a Qwen3 of the 4B width (hidden 2560, 32 / 8 heads, intermediate 9728;
vocabulary cut to 10,000 to fit in memory) with load/gpu_models.py's initialization, our model in
bf16 with and without the fold (EngineOptions.fold_norms) against our model in float32, 8 texts of 4..120
tokens in one batch.

    python load/fold_norms_cpu.py --layers 18,36     # writes load/results/fold-norms-cpu-DATE.{json,md}

Needs about 16 GB of memory and a few minutes a depth on 2 cores; checkpoints go to /tmp/fold.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from load.gpu_models import write_tokenizer  # noqa: E402
from load.results_file import write_results  # noqa: E402
from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.worker.engine import EagerEngine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402


def checkpoint(layers: int) -> str:
    import transformers as tf

    path = f"/tmp/fold/q4b-{layers}"
    if not os.path.exists(path + "/config.json"):
        torch.manual_seed(0)
        cfg = dict(hidden_size=2560, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=128, intermediate_size=9728, vocab_size=10000, max_position_embeddings=4096,
                   rope_theta=1000000.0)
        model = tf.Qwen3Model(tf.Qwen3Config(**cfg)).to(torch.bfloat16).eval()
        with torch.no_grad():  # as load/gpu_models.py: norms away from 1
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn_like(p))
        model.save_pretrained(path, max_shard_size="2GB")
        write_tokenizer(path, 10000)
    return path


def rows(path, batch, dtype, fold) -> np.ndarray:
    engine = EagerEngine(load_model(path, dtype=dtype, options=EngineOptions(fold_norms=fold)))
    return engine.submit(batch).result().astype(np.float64)


def min_cos(a, b) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="18,36")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(7)
    batch = pack([rng.integers(0, 10000, k, dtype=np.int32) for k in rng.integers(4, 120, 8)])
    results = []
    for layers in map(int, args.layers.split(",")):
        t = time.perf_counter()
        path = checkpoint(layers)
        ref = rows(path, batch, torch.float32, fold=False)
        r = {"layers": layers, "bf16_unfolded_min_cos": min_cos(rows(path, batch, torch.bfloat16, False), ref),
             "bf16_folded_min_cos": min_cos(rows(path, batch, torch.bfloat16, True), ref),
             "seconds": time.perf_counter() - t}
        print(r, flush=True)
        results.append(r)
    date = datetime.date.today().isoformat()
    header = (f"# Norm folding and bf16 accuracy at the Qwen3-4B width (CPU), {date}\n\n"
              f"torch {torch.__version__}, {os.cpu_count()} CPU cores. Our model in bf16 against our model in "
              f"float32, 8 texts in one batch. Command: `python load/fold_norms_cpu.py --layers {args.layers}`.\n\n")
    table = "| layers | bf16, checkpoint's norms (min cosine) | bf16, norms folded (min cosine) |\n| ---: | ---: | ---: |\n"
    table += "\n".join(f"| {r['layers']} | {r['bf16_unfolded_min_cos']:.5f} | {r['bf16_folded_min_cos']:.5f} |"
                       for r in results)
    write_results(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), f"fold-norms-cpu-{date}",
                  {"date": date, "torch": torch.__version__, "results": results}, header, table)


if __name__ == "__main__":
    main()
