"""The engine's small per-batch copies: torch's copy_ against the CUDA runtime's own call (worker/cudart.py).

    python load/bench_engine_copies.py [--shape qwen3-0.6b] [--calls 4000] [--out load/results/STEM]

Two tables. First, the host time of each call a lone query's batch makes around the GPU work,
in a tight loop ("warm") and with 2 ms of sleep before each call ("cold": what a core that idled
between queries pays). Then a lone 16-token query through CudaEngine.submit, its rows into a
pinned buffer, with the copies straight to the runtime (direct) or through copy_, the two
interleaved call by call so that the machine's drift falls on both alike, with 2 ms of spinning
between calls as the worker spins between queries: submit()'s own time and submit to result.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load.bench_grpc import machine  # noqa: E402
from load.results_file import write_results_to  # noqa: E402
from pollen.worker import cudart  # noqa: E402
from pollen.worker.engine import make_engine  # noqa: E402
from pollen.worker.models.loader import load_model  # noqa: E402
from pollen.worker.packed import pack  # noqa: E402


def host_time(call, cold: bool, n: int = 400) -> float:
    """Median µs of host time per call (the GPU is synchronized now and then, outside the timing)."""
    times = []
    for i in range(n):
        if cold:
            time.sleep(0.002)
        t = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - t)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times[50:]) / 1e3


def primitives(runtime: cudart.CudaRuntime, hidden: int) -> list[tuple[str, float, float]]:
    stream = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    host = torch.empty(4096, dtype=torch.int32, pin_memory=True)
    static = torch.zeros(4096, dtype=torch.int32, device="cuda")
    rows = torch.randn(64, hidden, device="cuda")
    out = torch.empty(64, hidden, dtype=torch.float32, pin_memory=True).numpy()
    n = 150  # int32 values: a 16-token query's inputs in the engine's layout
    torch.cuda.set_stream(stream)

    def enter_inference_mode():
        with torch.inference_mode():
            pass

    calls = [
        ("with torch.inference_mode()", enter_inference_mode),
        ("inputs up: Tensor.copy_ (600 bytes)", lambda: static[:n].copy_(host[:n], non_blocking=True)),
        ("inputs up: cudaMemcpyAsync", lambda: runtime.memcpy_async(
            static.data_ptr(), host.data_ptr(), n * 4, cudart.HOST_TO_DEVICE, stream.cuda_stream)),
        ("a row down: torch.from_numpy(record).copy_", lambda: torch.from_numpy(out[:1]).copy_(rows[:1], non_blocking=True)),
        ("a row down: cudaMemcpyAsync", lambda: runtime.memcpy_async(
            out.ctypes.data, rows.data_ptr(), hidden * 4, cudart.DEVICE_TO_HOST, stream.cuda_stream)),
    ]
    return [(name, host_time(call, False), host_time(call, True)) for name, call in calls]


def interleaved(engine, calls: int) -> dict[str, dict[str, float]]:
    runtime = engine.runtime
    out = torch.empty(1, engine.hidden, dtype=torch.float32, pin_memory=True).numpy()
    seq, flags = np.arange(16, dtype=np.int32) + 5, np.ones(1, np.int32)
    samples: dict[str, tuple[list, list]] = {"direct": ([], []), "copy_": ([], [])}
    with torch.inference_mode():  # as the worker runs its loop
        for i in range(calls):
            arm = "direct" if i % 2 == 0 else "copy_"
            engine.runtime = runtime if arm == "direct" else None
            spin_until = time.perf_counter_ns() + 2_000_000
            while time.perf_counter_ns() < spin_until:
                pass
            t0 = time.perf_counter_ns()
            pending = engine.submit(pack([seq]), out=out, normalize=flags)
            t1 = time.perf_counter_ns()
            pending.result()
            t2 = time.perf_counter_ns()
            if i >= 200:
                samples[arm][0].append((t1 - t0) / 1e3)
                samples[arm][1].append((t2 - t0) / 1e3)
    engine.runtime = runtime
    return {arm: {"submit_p50_us": statistics.median(sub), "submit_mean_us": statistics.mean(sub),
                  "result_p50_us": statistics.median(total), "result_p99_us": float(np.percentile(total, 99))}
            for arm, (sub, total) in samples.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    p.add_argument("--calls", type=int, default=4000)
    p.add_argument("--out", default="")
    args = p.parse_args()
    from load.gpu_models import make_checkpoint

    engine = make_engine(load_model(make_checkpoint(args.shape, args.root), device="cuda", dtype=torch.bfloat16),
                         "cuda", max_batch_tokens=8192)
    engine.warm_up(5.0)
    if engine.runtime is None:
        raise SystemExit("no CUDA runtime found in this process's maps: the engine uses copy_ only here")
    prims = primitives(engine.runtime, engine.hidden)
    arms = interleaved(engine, args.calls)
    result = {"date": datetime.date.today().isoformat(), "device": f"{torch.cuda.get_device_name()}, {machine()}",
              "versions": {"python": platform.python_version(), "torch": torch.__version__},
              "runtime": engine.runtime.path, "shape": args.shape,
              "primitives_us": {name: {"warm": warm, "cold": cold} for name, warm, cold in prims},
              "submit": arms}
    table = "\n".join(["| call | warm µs | cold µs |", "| --- | ---: | ---: |",
                       *(f"| {name} | {warm:.1f} | {cold:.1f} |" for name, warm, cold in prims), "",
                       "| copies | submit() p50 µs | submit() mean µs | submit to result p50 µs | p99 µs |",
                       "| --- | ---: | ---: | ---: | ---: |",
                       *(f"| {arm} | {a['submit_p50_us']:.1f} | {a['submit_mean_us']:.1f} | {a['result_p50_us']:.1f} | "
                         f"{a['result_p99_us']:.1f} |" for arm, a in arms.items())])
    header = (f"# The engine's small copies, {result['date']}\n\n{result['device']}; python {result['versions']['python']}, "
              f"torch {torch.__version__}; the {args.shape} shape, bf16, random weights; runtime "
              f"{os.path.basename(engine.runtime.path)}. Command: `python {' '.join(sys.argv)}`.\n\n")
    print(header + table)
    if args.out:
        write_results_to(args.out, result, header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
