"""One client's p50 by where the frontends' threads may run: an A/B inside each server start.

    python load/bench_placement.py --shape qwen3-0.6b --tokenizer TOKENIZER.json --out load/results/STEM
           [--starts 3] [--rounds 6] [--calls 400] [--device cuda]

One client's p50 moves by about 0.2 ms from one `pollen serve` start to the next on the same
machine (load/results/gpu-one-client-machine13-2026-12-02.md) while the worker's share stays put.
This asks whether that is placement: in each start, blocks of --calls queries from grpc's blocking
stub alternate between two placements of the frontends' threads, set from outside with
sched_setaffinity on every thread of every frontend:

  shared  as the supervisor leaves them: every frontend may run on any of the frontends' cores
  pinned  frontend i's threads (its event loop, gRPC's poller thread, the rest) on one core, the
          i-th of those cores

After each block it reads which frontend served the block (the one whose threads used the most CPU
time in it), the cores its two busiest threads and the client's thread last ran on, and the worker's.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load.bench_concurrency import add_model_args, query_texts, versions  # noqa: E402
from load.bench_one_client import figures  # noqa: E402
from load.gpu_models import make_checkpoint, with_tokenizer  # noqa: E402
from load.results_file import write_results_to  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402
from tests.test_frontends import frontend_pids  # noqa: E402

WARM_CALLS = 200
PLACEMENTS = ("shared", "pinned")


def threads(pid: int) -> dict[int, tuple[int, int]]:
    """{tid: (CPU ticks used, the core it last ran on)} for a process's threads."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended since the listing
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12]), int(fields[36]))  # utime + stime, processor
    return out


def affinity(pid: int) -> list[int]:
    """The cores any of a process's threads may run on."""
    allowed = set()
    for tid in threads(pid):
        try:
            allowed |= os.sched_getaffinity(tid)
        except ProcessLookupError:
            pass
    return sorted(allowed)


def pinned_core(index: int, cores: list[int]) -> int:
    """The one core frontend `index` runs on when pinned."""
    return cores[index % len(cores)]


def place(frontends: dict[int, int], cores: list[int], placement: str) -> None:
    for index, pid in sorted(frontends.items()):
        allowed = set(cores) if placement == "shared" else {pinned_core(index, cores)}
        for tid in threads(pid):
            try:
                os.sched_setaffinity(tid, allowed)
            except ProcessLookupError:
                pass


def block(stub, pb, texts: list[str], calls: int) -> dict:
    """`calls` queries one after the other; load/bench_one_client.py's figures of them."""
    wall, timings = [], []
    for n in range(calls):
        request = pb.EmbedRequest(texts=[texts[n % len(texts)]], normalize=True)
        began = time.perf_counter()
        answer = stub.Embed(request, timeout=60)
        wall.append(time.perf_counter() - began)
        timings.append((answer.timing.queue_us, answer.timing.inference_us))
    return figures(wall, timings)


def where(frontends: dict[int, int], before: dict, after: dict) -> dict:
    """The block's serving frontend (most CPU used in the block) and the cores its two busiest threads
    last ran on (threads that used a clock tick in the block: a sleeping one still shows an old core)."""
    def used(i: int, tid: int) -> int:
        return after[i][tid][0] - before[i].get(tid, (0, 0))[0]

    serving = max(frontends, key=lambda i: sum(used(i, tid) for tid in after[i]))
    busiest = sorted((tid for tid in after[serving] if used(serving, tid) > 0), key=lambda tid: used(serving, tid),
                     reverse=True)[:2]
    return {"serving": serving, "serving_cores": [after[serving][tid][1] for tid in busiest]}


def one_start(path: str, device: str, start: int, rounds: int, calls: int) -> list[dict]:
    """A fresh `pollen serve` (defaults), warmed, then `rounds` blocks of each placement in turn."""
    import grpc

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    texts, rows = query_texts(), []
    server = ServerProcess("--model", path, "--device", device, "--log-level", "WARNING").start(timeout=600)
    try:
        frontends = frontend_pids(server)
        cores = sorted(os.sched_getaffinity(frontends[0]))
        workers = server.worker_pids()
        with grpc.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            block(stub, pb, texts, WARM_CALLS)
            for round_ in range(rounds):
                for placement in PLACEMENTS:
                    place(frontends, cores, placement)
                    before = {i: threads(pid) for i, pid in frontends.items()}
                    row = {"start": start, "round": round_, "placement": placement} | block(stub, pb, texts, calls)
                    after = {i: threads(pid) for i, pid in frontends.items()}
                    row |= where(frontends, before, after)
                    row["pinned_core"] = pinned_core(row["serving"], cores) if placement == "pinned" else None
                    row["serving_affinity"] = affinity(frontends[row["serving"]])
                    row["client_core"] = threads(os.getpid())[os.getpid()][1]
                    row["worker_cores"] = sorted({c for w in workers for _, c in threads(w).values()})
                    rows.append(row)
                    print(row, flush=True)
            place(frontends, cores, "shared")
    finally:
        server.terminate()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--starts", type=int, default=3, help="server starts, each with its own A/B")
    p.add_argument("--rounds", type=int, default=6, help="blocks of each placement per start, alternating")
    p.add_argument("--calls", type=int, default=400, help="queries per block")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    path = with_tokenizer(make_checkpoint(args.shape, args.root), args.tokenizer)
    result = {"meta": versions(), "command": " ".join(shlex.quote(a) for a in sys.argv), "rows": []}
    for start in range(args.starts):
        result["rows"] += one_start(path, args.device, start, args.rounds, args.calls)
    write_results_to(args.out, result, header(result), table(result["rows"]))


def header(result: dict) -> str:
    m = result["meta"]
    return (f"# One client by the frontends' thread placement, {m['date']}\n\n{m.get('gpu', 'CPU')}, "
            f"{m['cores']} cores, torch {m['torch']}, grpcio {m['grpcio']}, Python {m['python']}. "
            f"Command: `{result['command']}`. grpc's blocking stub, one text a call; `server` is the "
            "answer's queue_us + inference_us, `rest` the wall time less that.\n\n")


def table(rows: list[dict]) -> str:
    lines = ["| start | placement | blocks | p50 ms (median of blocks) | p50 range | rest p50 ms | serving frontend(s) |",
             "| ---: | --- | ---: | ---: | --- | ---: | --- |"]
    for start in sorted({r["start"] for r in rows}):
        for placement in PLACEMENTS:
            mine = [r for r in rows if r["start"] == start and r["placement"] == placement]
            p50 = [r["p50_ms"] for r in mine]
            lines.append(f"| {start} | {placement} | {len(mine)} | {np.median(p50):.2f} | {min(p50):.2f}-{max(p50):.2f} | "
                         f"{np.median([r['rest_p50_ms'] for r in mine]):.2f} | "
                         f"{', '.join(sorted({str(r['serving']) for r in mine}))} |")
    blocks = ["", "Each block: start, round, placement, p50 / rest ms, the serving frontend's busiest threads' "
              "cores, the client's core, the worker's threads' cores.", ""]
    blocks += [f"- {r['start']} {r['round']} {r['placement']}: {r['p50_ms']:.2f} / {r['rest_p50_ms']:.2f}; "
               f"frontend {r['serving']} on {r['serving_cores']}, client on {r['client_core']}, "
               f"worker on {r['worker_cores']}" for r in rows]
    return "\n".join(lines + blocks) + "\n"


if __name__ == "__main__":
    main()
