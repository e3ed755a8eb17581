"""Can bulk work leave SMs free for a query? A toy on one GPU, not the engine.

    python load/bench_green_context.py [--configs 0:0,0:12,120:0,120:12] [--out load/results/STEM]

The query stands in for one interactive forward: 144 dependent small bf16 products (16 rows) on
a high-priority stream, timed with CUDA events. The bulk work stands in for a bulk batch: steps
of two 8192-row products, launched in a loop from a second thread on a normal-priority stream.
Each config SMS:CARVEOUT runs the bulk stream on all SMs (SMS 0) or in a CUDA green context of
SMS SMs (`torch.cuda.green_contexts`), with cuBLAS's SM carveout (`torch._C.
_set_sm_carveout_experimental`) at CARVEOUT (0: none). For each: bulk steps/s alone, bulk
steps/s beside the queries, and the queries' p50 / p95 beside the bulk work.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.results_file import write_results_to  # noqa: E402

ROWS, HIDDEN, INNER, QUERY_ROWS, QUERY_PRODUCTS = 8192, 1024, 3072, 16, 144


class Toy:
    def __init__(self):
        dev, bf16 = torch.device("cuda"), torch.bfloat16
        torch.manual_seed(0)
        self.a = torch.randn(ROWS, HIDDEN, device=dev, dtype=bf16)
        self.up = torch.randn(HIDDEN, INNER, device=dev, dtype=bf16)
        self.down = torch.randn(INNER, HIDDEN, device=dev, dtype=bf16)
        self.q = torch.randn(QUERY_ROWS, HIDDEN, device=dev, dtype=bf16)
        self.high = torch.cuda.Stream(priority=-1)
        self.contexts = []  # green contexts live as long as their streams

    def query(self) -> torch.Tensor:
        x = self.q
        for _ in range(QUERY_PRODUCTS // 2):
            x = (x @ self.up) @ self.down
        return x

    def bulk_step(self) -> torch.Tensor:
        return (self.a @ self.up) @ self.down

    def time_queries(self, n: int = 60) -> tuple[float, float]:
        times = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.high):
                start.record()
                self.query()
                end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            time.sleep(0.002)
        times.sort()
        return times[len(times) // 2], times[int(len(times) * 0.95)]

    def bulk_stream(self, sms: int) -> torch.cuda.Stream:
        if not sms:
            return torch.cuda.Stream(priority=0)
        green = torch.cuda.green_contexts.GreenContext.create(num_sms=sms, device_id=0)
        self.contexts.append(green)
        return green.Stream()

    def run(self, sms: int, carveout: int) -> dict:
        torch._C._set_sm_carveout_experimental(carveout or None)
        stream = self.bulk_stream(sms)
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.bulk_step()
        torch.cuda.synchronize()
        began = time.perf_counter()
        with torch.cuda.stream(stream):
            for _ in range(200):
                self.bulk_step()
        torch.cuda.synchronize()
        alone = 200 / (time.perf_counter() - began)
        stop, steps = threading.Event(), [0]

        def feed() -> None:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    for _ in range(4):
                        self.bulk_step()
                    steps[0] += 4
                    if steps[0] % 16 == 0:
                        stream.synchronize()  # keep the queue short

        feeder = threading.Thread(target=feed)
        feeder.start()
        time.sleep(0.3)
        began, before = time.perf_counter(), steps[0]
        p50, p95 = self.time_queries()
        beside = (steps[0] - before) / (time.perf_counter() - began)
        stop.set()
        feeder.join()
        torch.cuda.synchronize()
        return {"sms": sms, "carveout": carveout, "bulk_alone": alone, "bulk_beside": beside,
                "query_p50_ms": p50, "query_p95_ms": p95}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="0:0,0:12,0:24,120:0,120:12,128:0,124:0,112:0,96:0,64:0",
                   help="SMS:CARVEOUT,...: bulk on all SMs (0) or a green context of SMS SMs, cuBLAS carveout")
    p.add_argument("--out", default="")
    args = p.parse_args()
    toy = Toy()
    for _ in range(5):
        toy.query()
        toy.bulk_step()
    torch.cuda.synchronize()
    p50, p95 = toy.time_queries()
    rows = []
    for config in args.configs.split(","):
        sms, carveout = map(int, config.split(":"))
        rows.append(toy.run(sms, carveout))
        print(rows[-1], flush=True)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    head = (f"# Keeping SMs free for a query beside bulk work (toy), {time.strftime('%Y-%m-%d')}\n\n"
            f"{torch.cuda.get_device_name()} ({sm_count} SMs), torch {torch.__version__}. Command: "
            f"`python load/bench_green_context.py --configs {args.configs}`. Query alone: p50 {p50:.2f} / p95 "
            f"{p95:.2f} ms. A bulk step is two {ROWS}-row products.\n\n")
    table = "| bulk runs on | cuBLAS carveout | bulk steps/s alone | beside queries | query p50 / p95 ms |\n"
    table += "| --- | --- | --- | --- | --- |\n" + "".join(
        f"| {'all SMs' if not r['sms'] else str(r['sms']) + ' SMs (green context)'} | {r['carveout'] or 'none'} | "
        f"{r['bulk_alone']:,.0f} | {r['bulk_beside']:,.0f} | {r['query_p50_ms']:.2f} / {r['query_p95_ms']:.2f} |\n"
        for r in rows)
    print(head + table)
    if args.out:
        write_results_to(args.out, {"rows": rows}, head, table)


if __name__ == "__main__":
    main()
