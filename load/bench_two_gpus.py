"""One GPU against two, in the same run on a machine with two or more: `pollen serve --devices 0`
then `--devices 0,1`, and one GPU's worker killed under load.

    python load/bench_two_gpus.py --tokenizer TOKENIZER.json [--seconds 5]

docs      the bench_e2e docs workload (token ids, 16 texts a message, 4 streams of 32 messages in
          flight) through EmbedStream: tokens/s on one GPU and on two
queries   512 closed-loop unary clients sending texts (load/load_clients.py): queries/s, p50, p99
kill      on the two-GPU server, 128 unary clients for --kill-seconds; 2 s in, `kill -9` of the
          worker on GPU 1: every call must still be answered (errors counted), the worker must
          come back on GPU 1 (nvidia-smi's compute apps), and the server report SERVING after

Server flags: defaults, plus the request limits bench_e2e uses for its large docs messages.
Writes load/results/two_gpus-<kind>.md (load/results_file.py).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load import load_clients  # noqa: E402
from load.bench_concurrency import add_model_args, query_texts, server_processes, versions  # noqa: E402
from load.bench_e2e import stream_docs  # noqa: E402
from load.bench_engine import DOCS, docs  # noqa: E402
from load.gpu_models import SHAPES, make_checkpoint, with_tokenizer  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402

DEVICE = "cuda"  # --device; cpu only to check this script on a machine without GPUs


def gpu_of_pid() -> dict[int, int]:
    """pid -> GPU index, from nvidia-smi's compute apps (on a CPU run, a checking aid: each
    worker process counts as "GPU" -1)."""
    if DEVICE == "cpu":
        return {int(p): -1 for p in os.listdir("/proc") if p.isdigit()}
    def query(what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]

    index = {uuid: int(i) for i, uuid in query("gpu=index,uuid")}
    return {int(pid): index[uuid] for pid, uuid in query("compute-apps=pid,gpu_uuid")}


def ready_workers(server: ServerProcess) -> int:
    """pollen_ready_workers from /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"http://{server.http_listen}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("pollen_ready_workers "):
                return int(float(line.split()[1]))
    return 0


def worker_pid(server: ServerProcess, index: int) -> int | None:
    for pid in server.worker_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().startswith(f"pollen-worker[{index}]".encode()):
                return pid
    return None


def kill_under_load(server: ServerProcess, texts: list[str], seconds: float, processes: int) -> dict:
    """kill -9 of worker 1 two seconds into a 128-client unary run; what the clients and the server saw."""
    victim = worker_pid(server, 1)
    before = gpu_of_pid()
    load: dict = {}
    runner = threading.Thread(target=lambda: load.update(load_clients.run(
        "unary", server.listen, server.http_listen, 128, processes, texts, 0.0, seconds)))
    runner.start()
    time.sleep(1.5 + 2.0)  # load_clients starts its clock 1.5 s after the call
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    back = None
    while back is None and time.monotonic() - killed_at < 300:
        pid = worker_pid(server, 1)
        if pid not in (None, victim) and gpu_of_pid().get(pid) is not None and ready_workers(server) == 2:
            back = pid
        time.sleep(0.2)
    runner.join()
    return {"killed_pid": victim, "killed_gpu": before.get(victim), "clients": load,
            "new_pid": back, "new_gpu": gpu_of_pid().get(back) if back else None,
            "back_after_s": time.monotonic() - killed_at if back else None, "serving_after": server.healthy(),
            "ready_workers_after": ready_workers(server)}


def one_server(devices: str, path: str, d, texts, args) -> dict:
    where = ["--devices", devices] if DEVICE == "cuda" else ["--workers", str(devices.count(",") + 1)]
    flags = ["--model", path, "--device", DEVICE, *where, "--max-request-bytes", str(64 << 20),
             "--max-queued-tokens", str(64 << 20), "--max-texts-per-request", "32", "--log-level", "WARNING"]
    began = time.monotonic()
    server = ServerProcess(*flags).start(timeout=600)
    out: dict = {"serving_after_s": time.monotonic() - began}
    try:
        tokens = sum(len(s) for s in d)
        secs = asyncio.run(stream_docs(server.listen, d))
        out["docs_tokens_per_s"] = tokens / secs
        print(devices, "docs", out["docs_tokens_per_s"], flush=True)
        out["queries_512"] = load_clients.run("unary", server.listen, server.http_listen, 512,
                                              args.client_processes, texts, 1.0, args.seconds,
                                              watch=server_processes(server))
        print(devices, "queries", out["queries_512"], flush=True)
        if "," in devices:
            out["kill"] = kill_under_load(server, texts, args.kill_seconds, args.client_processes)
            print(devices, "kill", out["kill"], flush=True)
        out["sigterm_exit_code"] = server.terminate()
    finally:
        server.kill()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--kill-seconds", type=float, default=12.0)
    p.add_argument("--docs-scale", type=float, default=1.0)
    p.add_argument("--client-processes", type=int, default=8)
    add_out_argument(p, "two_gpus")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    path = with_tokenizer(make_checkpoint(args.shape, args.root), args.tokenizer)
    d = docs(int(DOCS.get(args.shape, 20000) * args.docs_scale), SHAPES[args.shape]["vocab_size"], 2048)
    texts = query_texts()
    result = {"meta": versions(), "one_gpu": one_server("0", path, d, texts, args), "two_gpus": one_server("0,1", path, d, texts, args)}
    write_result("two_gpus", device_kind(args.device), "One GPU against two through `pollen serve`",
                 header(result) + table(result), result, args.out)


def header(result: dict) -> str:
    m = result["meta"]
    return (f"{m.get('gpu', 'CPU')} x2, {m['cores']} cores, torch {m['torch']}, grpcio {m['grpcio']}, Python "
            f"{m['python']}, {m['date']}; server defaults (frontends by core count) plus bench_e2e's request "
            "limits; clients on the same machine.\n\n")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def ms(r: dict) -> str:
    return f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f}" if r["p50_ms"] is not None else "none answered"


def table(result: dict) -> str:
    one, two = result["one_gpu"], result["two_gpus"]
    q1, q2 = one["queries_512"], two["queries_512"]
    rows = ["| | --devices 0 | --devices 0,1 | ratio |", "| --- | --- | --- | --- |",
            f"| docs tokens/s (EmbedStream) | {one['docs_tokens_per_s']:,.0f} | {two['docs_tokens_per_s']:,.0f} | "
            f"{ratio(two['docs_tokens_per_s'], one['docs_tokens_per_s'])} |",
            f"| 512 unary clients, queries/s | {q1['queries_per_s']:,.0f} | {q2['queries_per_s']:,.0f} | "
            f"{ratio(q2['queries_per_s'], q1['queries_per_s'])} |",
            f"| 512 unary clients, p50 / p99 ms | {ms(q1)} | {ms(q2)} | |",
            f"| cores busy: frontends / workers / clients | {q1['cores_busy']['frontends']:.1f} / "
            f"{q1['cores_busy']['workers']:.1f} / {q1['cores_busy']['clients']:.1f} | "
            f"{q2['cores_busy']['frontends']:.1f} / {q2['cores_busy']['workers']:.1f} / "
            f"{q2['cores_busy']['clients']:.1f} | |"]
    k = two.get("kill")
    text = "\n".join(rows) + "\n"
    if k:
        c = k["clients"]
        back = f"{k['back_after_s']:.1f} s later on GPU {k['new_gpu']}" if k["new_pid"] else "never"
        text += (f"\n`kill -9` of the worker on GPU {k['killed_gpu']} 2 s into 128 unary clients: "
                 f"{c['completed']:,} calls answered in the window ({c['queries_per_s']:,.0f} q/s, p50 / p99 "
                 f"{ms(c)} ms), {c['errors']} errors; the worker came back {back}; "
                 f"SERVING afterwards: {k['serving_after']}, ready workers {k['ready_workers_after']}.\n")
    return text


if __name__ == "__main__":
    main()
