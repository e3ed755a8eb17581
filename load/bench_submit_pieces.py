"""A lone query's way through CudaEngine.submit, piece by piece, on the host's clock.

    python load/bench_submit_pieces.py --shape qwen3-0.6b --out load/results/gpu-submit-pieces-DATE

The worker's hop table (load/bench_query_hops.py) shows about 100-130 µs between the batch being
formed and the GPU starting (W2), against a GPU time of ~770 µs. This replays the same steps as
`CudaEngine._submit` and `run_on_lane` for one text of 8..32 tokens on the interactive lane, with
a timestamp between each, so each step's host cost is known: packing, the bucket, the slot's
event, the fill of the pinned slot, the stream switch, the upload, the graph's launch, the copy of
the rows out, the done event; then the wait until the event fires, against the graph's GPU time
(CUDA events around the replay). Between queries the thread spins for --gap-us, as the worker
does between requests. Needs a CUDA GPU.
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
from load.bench_engine import log, queries, versions  # noqa: E402
from load.gpu_models import SHAPES, make_checkpoint  # noqa: E402
from load.results_file import write_results_to  # noqa: E402
from pollen.worker import cudart  # noqa: E402
from pollen.worker.cuda_engine import INTERACTIVE, CudaEngine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402

STEPS = ["pack", "bucket", "slot event", "fill", "set stream", "upload", "launch", "rows out", "done event",
         "wait for the GPU", "(general pack, for comparison)", "(general fill, for comparison)"]
ON_THE_PATH = len(STEPS) - 2


def spin(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def one(engine: CudaEngine, seq: np.ndarray, out: np.ndarray, gpu: list[float]) -> list[int]:
    """One query through the engine's steps; the ns after each step."""
    now = time.perf_counter_ns
    lane = engine.lanes[INTERACTIVE]
    marks = [now()]
    batch = pack([seq])
    marks.append(now())
    shape = engine.bucket(batch)
    graph = lane.graphs[shape]
    marks.append(now())
    slot = lane.next_slot()
    lane.staged[slot].synchronize()
    marks.append(now())
    used = engine.fill(lane.host_np[slot], batch, shape, np.ones(1, np.int32))
    marks.append(now())
    torch.cuda.set_stream(lane.stream)
    marks.append(now())
    engine.upload(lane, slot, used)
    marks.append(now())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(lane.stream)
    graph[0].replay()
    end.record(lane.stream)
    marks.append(now())
    rows = graph[1]
    engine.runtime.memcpy_async(out.ctypes.data, rows.data_ptr(), out.nbytes, cudart.DEVICE_TO_HOST,
                                lane.stream.cuda_stream)
    marks.append(now())
    done = lane.done[slot]
    done.record(lane.stream)
    marks.append(now())
    while not done.query():
        pass
    marks.append(now())
    # For comparison, off the query's path: the general packing and fill a one-text batch took
    # before the one-text shortcuts (worker/packed.py _pack_one, CudaEngine.fill_one_text).
    general = pack([seq], [[(0, len(seq))]])
    marks.append(now())
    engine.fill_general(lane.host_np[1 - slot], general, shape, np.ones(1, np.int32))
    marks.append(now())
    gpu.append(start.elapsed_time(end) * 1000)
    return marks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    p.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--gap-us", type=float, default=1000.0, help="spin between queries, as the worker waits")
    args = p.parse_args()
    path = make_checkpoint(args.shape, args.root)
    vocab = SHAPES[args.shape]["vocab_size"]
    model = load_model(path, device="cuda", dtype=torch.bfloat16)
    engine = CudaEngine(model, "cuda", max_batch_tokens=4096, cuda_graphs=True)
    engine.warm_up(budget_s=60.0)
    qs = queries(args.queries + 50, vocab)
    out = torch.empty(1, model.spec.hidden_size, dtype=torch.float32, pin_memory=True).numpy()
    gpu: list[float] = []
    steps = []
    with torch.inference_mode():
        for s in qs:  # captures any bucket warm_up left out
            engine.submit(pack([s])).result()
        for i, s in enumerate(qs):
            spin(args.gap_us)
            marks = one(engine, s, out, gpu)
            if i >= 50:
                steps.append(np.diff(marks) / 1000)
    steps = np.array(steps)
    gpu_us = np.array(gpu[50:])
    meta = versions()
    meta["date"] = datetime.date.today().isoformat()
    table = {name: {"p50_us": float(np.percentile(steps[:, i], 50)), "mean_us": float(steps[:, i].mean())}
             for i, name in enumerate(STEPS)}
    table["graph on the GPU (events)"] = {"p50_us": float(np.percentile(gpu_us, 50)), "mean_us": float(gpu_us.mean())}
    total = steps[:, :ON_THE_PATH].sum(axis=1)
    table["submit to rows, host clock"] = {"p50_us": float(np.percentile(total, 50)), "mean_us": float(total.mean())}
    lines = ["| step | p50 µs | mean µs |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {v['p50_us']:.1f} | {v['mean_us']:.1f} |" for name, v in table.items()]
    header = (f"# A lone query through CudaEngine.submit, step by step, {meta['date']}\n\n"
              f"{meta.get('gpu', '')} torch {torch.__version__}. {args.shape}, random weights, bf16, graphs; "
              f"{len(steps)} queries of 8..32 tokens, {args.gap_us:.0f} µs of spinning between them. Command: "
              f"`python load/bench_submit_pieces.py --shape {args.shape} --gap-us {args.gap_us:.0f} --out {args.out}`.\n\n")
    write_results_to(args.out, {"meta": meta, "steps": table}, header, "\n".join(lines))
    print(header + "\n".join(lines))
    log("done")


if __name__ == "__main__":
    main()
