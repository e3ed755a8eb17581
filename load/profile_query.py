"""Where one short query's time goes on the GPU: kernel count and time per kernel kind.

    python load/profile_query.py --shape qwen3-0.6b [--tokens 16] [--engine-options skinny=0,...]

Runs the eager forward under torch.profiler (GPU time per kernel, free of launch gaps), then times
the graph replay alone and the whole submit→result path with CUDA events.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.gpu_models import make_checkpoint  # noqa: E402
from pollen.common.engine_options import EngineOptions  # noqa: E402
from pollen.worker.cuda_engine import CudaEngine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    p.add_argument("--engine-options", type=EngineOptions.parse, default=EngineOptions(),
                   help="NAME=VALUE,... of pollen.common.engine_options.EngineOptions")
    args = p.parse_args()
    path = make_checkpoint(args.shape, args.root)
    model = load_model(path, device="cuda", dtype=torch.bfloat16, options=args.engine_options)
    engine = CudaEngine(model, "cuda", max_batch_tokens=16384)
    engine.warm_up()
    batch = pack([np.arange(args.tokens, dtype=np.int32) + 100])
    for _ in range(5):
        engine.submit(batch).result()
    shape = engine.bucket(batch)
    graph, _ = engine.graphs[shape]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    end.synchronize()
    print(f"graph replay alone: {start.elapsed_time(end) / 100 * 1000:.0f} us  (bucket {shape})")
    t = time.perf_counter()
    for _ in range(100):
        engine.submit(batch).result()
    print(f"submit->result: {(time.perf_counter() - t) / 100 * 1e6:.0f} us")

    inputs, _ = engine.views(engine.lanes[0].static_in, *shape[:2], shape[1])
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.forward(inputs, shape[2])
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / 3
    print(f"eager forward: {len(kernels) / 3:.0f} kernels, {total:.0f} us of GPU time")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


if __name__ == "__main__":
    main()
