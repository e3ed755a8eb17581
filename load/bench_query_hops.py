"""Where one query's time goes, hop by hop: timestamps at each step between the client and the model.

    python load/bench_query_hops.py                          # a one-layer micro BERT on the CPU
    python load/bench_query_hops.py --shape qwen3-0.6b --device cuda --tokenizer TOKENIZER.json \
        [--server-flags "..."] [--calls 2000] --out load/results/STEM

load/bench_query_path.py splits a query's round trip into four parts from outside (the gRPC
floor, queue_us, inference_us, the rest). This one names every hop: it copies the package into a
temporary folder, puts a probe line (CLOCK_MONOTONIC to a per-process file) before or after the
statements in PROBES, and runs `pollen serve` from that copy, so the installed package and the
data path of every other run stay as they are. One client, one text per call, one call at a time.
A probe costs a few microseconds (one line written), which the hops after it carry.

A probe's anchor must be found exactly once in its file; when the code moves, the run stops and
names the probe to fix.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import glob
import os
import pathlib
import platform
import shlex
import shutil
import sys
import tempfile
import time

import grpc
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load.bench_grpc import machine  # noqa: E402
from load.results_file import write_results_to  # noqa: E402
from pollen.v1 import embedder_pb2 as pb  # noqa: E402
from pollen.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402

TEXT = "how do I keep a sourdough starter alive while on a two week holiday"

# (name, file in the package, anchor: one or more whole lines, where the probe goes: "before" or
# "after" the anchor, or "between" its two lines; what the hop that ends at this probe covers).
PROBES = [
    ("F0", "server/service.py", "        remaining = context.time_remaining()", "before",
     "the client's call reaches the frontend's Embed handler (gRPC: client, wire, server, poller thread)"),
    ("F1", "server/router.py", "        now = time.monotonic_ns()\n        if deadline_ns and deadline_ns <= now:", "before",
     "admission: the request's checks and its tokenization"),
    ("F2", "server/channel.py", "        self.flush()\n        if self.spin_ns:", "between",
     "the request record encoded and written into the request ring"),
    ("W0", "worker/loop.py", "                    self.batcher.add(Job.of(records.decode_request(view), link.frontend))",
     "after", "the worker reads it (a spinning worker at once; a sleeping one on the ring's eventfd)"),
    ("W1", "worker/loop.py", "        start_ns = time.monotonic_ns()\n        spans = sorted(", "before",
     "the batcher forms the batch"),
    ("W2", "worker/loop.py", "        batch = InFlight(lane, parts, pending, error, start_ns)", "before",
     "answer plan, record reserved, packing, engine.submit (the GPU starts inside it)"),
    ("W3", "worker/loop.py", "        error, rows = batch.error, None", "before",
     "the batch runs to its end, seen by the worker"),
    ("W4", "worker/loop.py", "            part.link.responses.notify_consumer()", "before",
     "the answer record filled and committed"),
    ("F3", "server/channel.py", "        ring = self.responses\n        Ring.drain_signal(ring.data_fd)", "before",
     "the frontend's event loop reads the response ring (a polling one at once; else on the eventfd)"),
    ("F4", "server/channel.py", "        if not sent.future.done():\n            sent.future.set_result(result)", "before",
     "the answer read and decoded, metrics observed"),
    ("F5", "server/service.py", "        if result.status:", "before",
     "the handler's coroutine resumes"),
    ("F6", "server/service.py", '        count_request(door, "ok", response.rows, response.usage.prompt_tokens)', "before",
     "the EmbedResponse built"),
    ("C1", "", "", "", "counted, returned to gRPC, sent; the client has the answer"),
]
ORDER = ["C0"] + [name for name, *_ in PROBES]

PROBE_MODULE = '''"""bench_query_hops' probe: one line per mark, NAME and CLOCK_MONOTONIC ns, in its process's file."""
import os
import time

_file = None


def mark(name):
    global _file
    if _file is None:
        _file = open(os.path.join({events!r}, f"{{os.getpid()}}.txt"), "a", buffering=1)
    _file.write(f"{{name}} {{time.monotonic_ns()}}\\n")
'''


def probed_copy(root: pathlib.Path, events: str) -> pathlib.Path:
    """The package laid out as installed (pollen/, pollen/server/, ...) under root, with the probes."""
    package = root / "pollen"
    shutil.copytree(REPO / "protos" / "pollen", package)
    for part in ("common", "server", "shared_mem", "worker", "client", "bulk"):
        shutil.copytree(REPO / part, package / part, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "hop_probe.py").write_text(PROBE_MODULE.format(events=events))
    for name, path, anchor, where, _ in PROBES:
        if not path:
            continue
        file = package / path
        text = file.read_text()
        if text.count(anchor) != 1:
            raise SystemExit(f"probe {name}: its anchor is in {path} {text.count(anchor)} times, not once; update PROBES")
        lines = anchor.split("\n")
        line = lines[0] if where == "before" else lines[-1]
        probe = f"{line[:len(line) - len(line.lstrip())]}__import__('pollen.hop_probe').hop_probe.mark({name!r})"
        probed = {"before": [probe, *lines], "after": [*lines, probe], "between": [lines[0], probe, *lines[1:]]}
        text = text.replace(anchor, "\n".join(probed[where]))
        file.write_text(text)
    return root


def read_events(events: str) -> tuple[np.ndarray, list[str]]:
    marks = []
    for path in glob.glob(os.path.join(events, "*.txt")):
        with open(path) as f:
            marks += [(int(ns), name) for name, ns in (line.split() for line in f)]
    marks.sort()
    return np.array([ns for ns, _ in marks], dtype=np.int64), [name for _, name in marks]


def hops(calls: list[tuple[int, int]], ns: np.ndarray, names: list[str]) -> dict[str, list[float]]:
    """Per call, each probe's first mark inside the call (the frontend's wake-up: its last before
    the answer is read), and the µs from the previous probe in ORDER."""
    gaps: dict[str, list[float]] = collections.defaultdict(list)
    for t0, t1 in calls:
        a, b = np.searchsorted(ns, t0), np.searchsorted(ns, t1)
        at: dict[str, int] = {"C0": t0}
        for i in range(a, b):
            if names[i] == "F3" and "F4" not in at:
                at["F3"] = int(ns[i])
            at.setdefault(names[i], int(ns[i]))
        at["C1"] = t1
        if any(name not in at for name in ORDER):
            continue  # a mark fell outside the call (the worker's answer beat the frontend's probe)
        for prev, name in zip(ORDER, ORDER[1:]):
            gaps[name].append((at[name] - at[prev]) / 1e3)
        gaps["total"].append((t1 - t0) / 1e3)
    return gaps


def main() -> int:
    from load.bench_query_path import add_model_args, query_model

    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    model_dir = query_model(args)
    flags = ["--worker-threads", "1"] if args.device == "cpu" else []
    work = pathlib.Path(tempfile.mkdtemp(prefix="pollen-hops-"))
    events = str(work / "events")
    os.makedirs(events)
    tree = probed_copy(work / "tree", events)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH", "")]))}
    server = ServerProcess("--model", model_dir, "--device", args.device, "--http-listen", "", *flags,
                           *shlex.split(args.server_flags), env=env).start(timeout=600)
    calls = []
    try:
        with grpc.insecure_channel(server.listen) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            request = pb.EmbedRequest(texts=[TEXT], normalize=True)
            for _ in range(200):
                stub.Embed(request)
            time.sleep(0.2)
            for path in glob.glob(os.path.join(events, "*.txt")):
                os.truncate(path, 0)  # the warm-up's marks (files are opened for appending)
            for _ in range(args.calls):
                t0 = time.monotonic_ns()
                stub.Embed(request)
                calls.append((t0, time.monotonic_ns()))
            time.sleep(0.2)
    finally:
        server.terminate()
    gaps = hops(calls, *read_events(events))
    shutil.rmtree(work, ignore_errors=True)
    if not gaps:
        raise SystemExit("no call had every probe's mark: were the probes loaded? (PYTHONPATH)")
    what = {"C0": "", **{name: text for name, _, _, _, text in PROBES}}
    rows = [(name, what[name], float(np.percentile(gaps[name], 50)), float(np.mean(gaps[name]))) for name in ORDER[1:]]
    total50 = float(np.percentile(gaps["total"], 50))
    result = {"date": datetime.date.today().isoformat(), "device": machine() if args.device == "cpu" else None,
              "versions": {"python": platform.python_version(), "grpcio": grpc.__version__},
              "shape": args.shape or "micro-bert", "device_kind": args.device, "server_flags": args.server_flags,
              "calls": len(calls), "calls_with_every_mark": len(gaps["total"]),
              "round_trip_p50_us": total50, "round_trip_p99_us": float(np.percentile(gaps["total"], 99)),
              "hops": {name: {"p50_us": p50, "mean_us": mean} for name, _, p50, mean in rows}}
    if args.device == "cuda":
        import torch

        result["device"] = f"{torch.cuda.get_device_name()}, {machine()}"
        result["versions"]["torch"] = torch.__version__
    table = "\n".join(["| to | the hop | p50 µs | mean µs |", "| --- | --- | ---: | ---: |",
                       *(f"| {name} | {text} | {p50:,.1f} | {mean:,.1f} |" for name, text, p50, mean in rows),
                       f"| | sum of the hops' means; the round trip's p50 | {sum(m for *_, m in rows):,.1f} | "
                       f"{total50:,.1f} |"])
    model = (f"the {args.shape} shape, random weights, bf16" if args.shape
             else "a one-layer random BERT (hidden 32), one worker thread")
    header = (f"# One query's hops on {args.device}, {result['date']}\n\n{result['device']}; python "
              f"{result['versions']['python']}, grpcio {grpc.__version__}; {model}; one text "
              f"({TEXT!r}), one call at a time, {len(gaps['total'])} of {len(calls)} calls with every mark. "
              f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`.\n\n")
    print(header + table)
    if args.out:
        write_results_to(args.out, result, header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
