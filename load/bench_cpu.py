"""The CPU benchmark: `pollen serve` on the CPU against sentence-transformers, ONNX Runtime and (when it
imports) fastembed, on the same texts and the same model (all-MiniLM-L6-v2, the default), in alternating
rounds, on a quiet machine and under a stated background load; pollen on its default engine (ONNX
Runtime on an export of its own model code) and on its torch engine.

    python load/bench_cpu.py                        # the full run: writes load/results/cpu-cpu.md
    python load/bench_cpu.py --smoke [--out FILE]   # tiny sizes, about a minute; no file without --out

Contenders (load/cpu_contenders.py; --contenders picks them, default pollen,pollen-torch,engine,st,ort,fastembed):
  pollen     `pollen serve` on its defaults plus each --pollen-flag (e.g. --pollen-flag=--worker-threads=1):
             the model on ONNX Runtime (worker/onnx_engine.py), its export made once at the benchmark's
             start into --onnx-dir (--onnx-cache); queries by unary Embed from this process, docs over
             EmbedStream on --streams streams (a connection each) of --per-message texts per message.
  pollen-torch  the same with --cpu-engine torch: pollen's torch engine (worker/eager_engine.py).
  engine     pollen's CPU engine without the server (bulk/'s BulkEmbedder: the server's tokenizer, packing
             and engine, ONNX Runtime's as the server's, with the worker's thread choice), in a child process
             with the worker's environment; a query is one packed batch, docs are packed in order into
             batches of the server's CPU budget (1,024 tokens per worker thread). pollen's figures less
             these are what the server's trip costs.
  st         SentenceTransformer(folder, device="cpu") in a child process: a query is encode([text]),
             docs are encode(docs, batch_size=--batch-size) (sentence-transformers sorts them by length).
  ort        the checkpoint exported to ONNX at start (torch.onnx.export, TorchScript exporter, dynamic
             batch and sequence axes; re-exported unless the cached export's stamp matches the weights'
             sha256 and the torch/transformers versions; --onnx-dir, default <tmp>/pollen-bench-cpu-onnx),
             an InferenceSession (CPU provider, intra-op threads --threads, default every core; all graph
             optimizations) in a child process, `tokenizers` from the folder's tokenizer.json (truncation
             256, padding per batch), mean pooling and L2 norm in numpy; docs in batches of --batch-size,
             sorted by length first as sentence-transformers' encode does (--ort-unsorted: in the given
             order, as fastembed does; about 1.6x slower on these docs), queries one at a time.
  fastembed  fastembed's TextEmbedding on the same ONNX export (it cannot load the model from the Hub
             here), in a child process; skipped, and said so, when it does not import. fastembed 0.9 wants
             huggingface_hub<2, which this environment's transformers refuses, so install it apart
             (pip install --target DIR fastembed loguru mmh3 py_rust_stemmers pillow "huggingface_hub<2"
             --no-deps) and pass --fastembed-site DIR: only its child process sees DIR.
st, ort and fastembed run as their users run them: the tokenizers library's thread pool on
(TOKENIZERS_PARALLELISM unset in their child processes, load/library_defaults.py).

Workloads, fixed seeds: --queries short texts (an STS-B sentence's first clause), one text per call, one
after the other, latency per call; --docs texts of 1, 2, 4 or 8 STS-B sentences (tokens counted by the
model's tokenizer, truncated at 256). Every contender's vectors are checked against sentence-transformers'
(encode at batch 64, once at start) on the same texts: cosine >= 0.9999 on every row of every run, or
the benchmark stops.

Rounds: --rounds (3); in each, every contender runs once quiet and once busy (the order of the two
conditions, and of the contenders, reversed every other round). A contender is started for its run
(timed: to health SERVING for pollen, whose ONNX export the benchmark's start made, so a warm
cache's start; to the child's first answer for the others) and warmed up (20 queries, one docs batch); in the busy condition --busy (2)
background processes, each a tight pure-Python loop (`while True: pass`, default priority, not pinned),
start after the warm-up and stop after the docs. Measured per run: query p50/p99 ms; CPU seconds of
the contender's processes (/proc utime+stime of pollen's supervisor and all its descendants, of the
child process for the others) per query and for the docs; the client's (this process's) CPU seconds
apart; docs texts/s and tokens/s; PSS, RSS and peak RSS of each process after the docs. The table gives
the median over rounds (min..max); the ratios the issue asks for follow it.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from load import cpu_contenders as cc  # noqa: E402
from load.results_file import add_out_argument, write_result  # noqa: E402
from tests.texts import stsb_pairs  # noqa: E402

NAMES = {"pollen": "pollen", "pollen-torch": "pollen (torch engine)", "engine": "pollen engine", "st": "sentence-transformers", "ort": "ONNX Runtime",
         "fastembed": "fastembed"}
MIN_COSINE = 0.9999
BUSY_CODE = "while True: pass"


def make_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    sentences = [a for a, _, _ in stsb_pairs()]
    return [" ".join(rng.sample(sentences, rng.choice((1, 1, 2, 4, 8)))) for _ in range(n)]


def make_queries(n: int, seed: int) -> list[str]:
    return [d.split(".")[0] for d in make_docs(n, seed)]


def machine() -> str:
    """`<cpu model>, <n> cores`."""
    m = machine_details()
    return f"{m['cpu']}, {m['cores']} cores"


def machine_details() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown cpu"
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) // 1024
    except (OSError, StopIteration):
        mem = None
    return {"cpu": name, "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)), "memory_mib": mem,
            "kernel": platform.release()}


class BusyLoad:
    """K processes each spinning `while True: pass`."""

    def __init__(self, k: int):
        self.k, self.procs = k, []

    def __enter__(self) -> BusyLoad:
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY_CODE]) for _ in range(self.k)]
        if self.procs:
            time.sleep(0.3)  # running before the workload starts
            self.t0 = cc.cpu_ticks([p.pid for p in self.procs])
        return self

    def cpu_seconds(self) -> float:
        return cc.cpu_seconds_between(self.t0, cc.cpu_ticks([p.pid for p in self.procs])) if self.procs else 0.0

    def __exit__(self, *exc) -> None:
        self.used_s = round(self.cpu_seconds(), 2)
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def make_contender(key: str, args, onnx: dict | None, model_dir: str):
    threads = args.threads or os.cpu_count()
    cache = ["--onnx-cache", args.onnx_dir] if args.onnx_dir else []
    if key == "pollen":
        return cc.PollenContender([*cache, *args.pollen_flag], args.streams, args.per_message)
    if key == "pollen-torch":
        return cc.PollenContender([*args.pollen_flag, "--cpu-engine", "torch"], args.streams, args.per_message, key)
    if key == "engine":
        from pollen.common import defaults
        from pollen.common.model_spec import read_model_spec
        from pollen.server.config import CPU_WORKER_ENV, ServeConfig

        serve = ServeConfig(device="cpu")
        batch_tokens = defaults.batch_tokens("cpu", serve.worker_threads, read_model_spec(model_dir).max_tokens)
        return cc.ChildContender(key, "pollen-engine", {"model_dir": model_dir, "batch_tokens": batch_tokens,
                                                        "threads": serve.worker_threads, "onnx_cache": args.onnx_dir},
                                 env=CPU_WORKER_ENV, library=False)
    if key == "st":
        return cc.ChildContender(key, "st", {"model_dir": model_dir, "batch_size": args.batch_size})
    if key == "ort":
        return cc.ChildContender(key, "ort", {"onnx_path": onnx["path"], "batch_size": args.batch_size, "threads": threads,
                                              "tokenizer_path": os.path.join(model_dir, "tokenizer.json"),
                                              "sort": not args.ort_unsorted})
    if key == "fastembed":
        return cc.ChildContender(key, "fastembed", {"onnx_dir": os.path.dirname(onnx["path"]),
                                                    "batch_size": args.batch_size, "threads": threads},
                                 sys_path=[args.fastembed_site] if args.fastembed_site else None)
    raise ValueError(key)


def min_cosine(vectors: np.ndarray, reference: np.ndarray) -> float:
    assert vectors.shape == reference.shape, (vectors.shape, reference.shape)
    a = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return float((a * reference).sum(axis=1).min())


def checked(key: str, what: str, vectors: np.ndarray, reference: np.ndarray) -> float:
    low = min_cosine(vectors, reference)
    norms = np.linalg.norm(vectors, axis=1)
    if low < MIN_COSINE or not np.allclose(norms, 1, atol=1e-3):
        raise SystemExit(f"FAIL: {NAMES[key]} {what}: min cosine to sentence-transformers {low:.6f} "
                         f"(must be >= {MIN_COSINE}), norms {norms.min():.4f}..{norms.max():.4f}")
    return low


def one_run(key: str, condition: str, args, texts: dict, reference: dict, onnx, model_dir: str) -> dict:
    """Start a contender, warm it up, then (under the load, if busy) its queries and its docs."""
    contender = make_contender(key, args, onnx, model_dir)
    t0 = time.perf_counter()
    contender.start()
    try:
        t1 = time.perf_counter()
        contender.embed_queries(texts["queries"][:args.warmup_queries])
        contender.embed_docs(texts["docs"][:args.batch_size])
        t2 = time.perf_counter()
        with BusyLoad(args.busy if condition == "busy" else 0) as load:
            pids = contender.pids()
            with open("/proc/loadavg") as f:
                loadavg = f.read().split()[0]
            c0, u0 = cc.cpu_ticks(pids), time.process_time()
            q = contender.embed_queries(texts["queries"])
            c1, u1 = cc.cpu_ticks(contender.pids()), time.process_time()
            d = contender.embed_docs(texts["docs"])
            c2, u2 = cc.cpu_ticks(contender.pids()), time.process_time()
            mem = cc.memory(contender.pids(), contender.labels())
    finally:
        contender.close()
    n_q, n_d = len(texts["queries"]), len(texts["docs"])
    lat = np.array(q["latencies_ms"])
    docs_cpu = cc.cpu_seconds_between(c1, c2)
    run = {
        "contender": key, "condition": condition, "loadavg_1m_before": float(loadavg),
        "busy_processes": args.busy if condition == "busy" else 0, "busy_cpu_s": load.used_s,
        "start_s": t1 - t0, "warmup_s": t2 - t1,
        "queries": {"n": n_q, "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                    "mean_ms": float(lat.mean()), "seconds": q["seconds"],
                    "cpu_s": cc.cpu_seconds_between(c0, c1), "client_cpu_s": u1 - u0,
                    "min_cosine": checked(key, "queries", q["vectors"], reference["queries"])},
        "docs": {"n": n_d, "tokens": texts["docs_tokens"], "seconds": d["seconds"],
                 "texts_per_s": n_d / d["seconds"], "tokens_per_s": texts["docs_tokens"] / d["seconds"],
                 "cpu_s": docs_cpu, "client_cpu_s": u2 - u1,
                 "min_cosine": checked(key, "docs", d["vectors"], reference["docs"])},
        "memory": mem, "info": contender.info,
    }
    run["queries"]["cpu_ms_per_query"] = run["queries"]["cpu_s"] / n_q * 1e3
    run["queries"]["client_cpu_ms_per_query"] = run["queries"]["client_cpu_s"] / n_q * 1e3
    run["docs"]["cpu_ms_per_text"] = docs_cpu / n_d * 1e3
    if "server_tokens" in d:
        run["docs"]["server_tokens"] = d["server_tokens"]
    run["min_cosine"] = min(run["queries"]["min_cosine"], run["docs"]["min_cosine"])
    return run


METRICS = [  # (key in the row, how to read it from a run, header, digits)
    ("query_p50_ms", lambda r: r["queries"]["p50_ms"], "query p50 ms", 2),
    ("query_p99_ms", lambda r: r["queries"]["p99_ms"], "query p99 ms", 2),
    ("cpu_ms_per_query", lambda r: r["queries"]["cpu_ms_per_query"], "CPU ms / query", 2),
    ("client_cpu_ms_per_query", lambda r: r["queries"]["client_cpu_ms_per_query"], "client CPU ms / query", 2),
    ("docs_texts_per_s", lambda r: r["docs"]["texts_per_s"], "docs texts/s", 1),
    ("docs_tokens_per_s", lambda r: r["docs"]["tokens_per_s"], "docs tokens/s", 0),
    ("docs_cpu_s", lambda r: r["docs"]["cpu_s"], "docs CPU s", 2),
    ("pss_mib", lambda r: r["memory"]["pss_mib"], "PSS MiB (all processes)", 0),
    ("start_s", lambda r: r["start_s"], "start s", 2),
]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def cell(s: dict, digits: int) -> str:
    def f(v: float) -> str:
        return f"{v:,.{digits}f}"

    return f(s["median"]) if len(s["values"]) == 1 else f"{f(s['median'])} ({f(s['min'])}..{f(s['max'])})"


def summarize(runs: list[dict], keys: list[str], conditions: list[str]) -> list[dict]:
    rows = []
    for key in keys:
        for condition in conditions:
            mine = [r for r in runs if r["contender"] == key and r["condition"] == condition]
            if not mine:
                continue
            row = {"contender": key, "condition": condition, "rounds": len(mine),
                   "min_cosine": min(r["min_cosine"] for r in mine)}
            for name, read, _, _ in METRICS:
                row[name] = spread([read(r) for r in mine])
            labels = sorted({label for r in mine for label in r["memory"]["processes"]})
            row["memory_per_process"] = {
                label: {m: statistics.median(r["memory"]["processes"][label][m] for r in mine
                                             if label in r["memory"]["processes"])
                        for m in ("pss_mib", "rss_mib", "peak_rss_mib")} for label in labels}
            rows.append(row)
    return rows


def ratio(rows: list[dict], runs: list[dict], metric: str, a: tuple[str, str], b: tuple[str, str]) -> dict | None:
    """a's median over b's, and the same ratio round by round (where both ran in that round)."""
    find = {(r["contender"], r["condition"]): r for r in rows}
    if a not in find or b not in find:
        return None
    read = next(f for name, f, _, _ in METRICS if name == metric)
    per_round = []
    for rnd in sorted({r["round"] for r in runs}):
        x = [read(r) for r in runs if (r["contender"], r["condition"], r["round"]) == (*a, rnd)]
        y = [read(r) for r in runs if (r["contender"], r["condition"], r["round"]) == (*b, rnd)]
        if x and y and y[0]:
            per_round.append(x[0] / y[0])
    den = find[b][metric]["median"]
    return {"value": find[a][metric]["median"] / den if den else None, "per_round": per_round}


RATIOS = [  # (name, metric, numerator, denominator, target: (op, bound) or None)
    ("pollen / pollen (torch engine) query p50, quiet", "query_p50_ms", ("pollen", "quiet"), ("pollen-torch", "quiet"), None),
    ("pollen / pollen (torch engine) docs texts/s, quiet", "docs_texts_per_s", ("pollen", "quiet"), ("pollen-torch", "quiet"), None),
    ("pollen / pollen (torch engine) query p50, busy", "query_p50_ms", ("pollen", "busy"), ("pollen-torch", "busy"), None),
    ("pollen / pollen (torch engine) docs texts/s, busy", "docs_texts_per_s", ("pollen", "busy"), ("pollen-torch", "busy"), None),
    ("pollen / ORT query p50, quiet", "query_p50_ms", ("pollen", "quiet"), ("ort", "quiet"), None),
    ("pollen / ORT docs texts/s, quiet", "docs_texts_per_s", ("pollen", "quiet"), ("ort", "quiet"), None),
    ("pollen / ORT CPU seconds per query, quiet", "cpu_ms_per_query", ("pollen", "quiet"), ("ort", "quiet"), ("<=", 1.2)),
    ("pollen docs texts/s, busy / quiet", "docs_texts_per_s", ("pollen", "busy"), ("pollen", "quiet"), (">=", 0.5)),
    ("pollen / sentence-transformers docs texts/s, busy", "docs_texts_per_s", ("pollen", "busy"), ("st", "busy"), None),
    ("pollen query p50, busy / quiet", "query_p50_ms", ("pollen", "busy"), ("pollen", "quiet"), ("<=", 3.0)),
    ("ORT docs texts/s, busy / quiet", "docs_texts_per_s", ("ort", "busy"), ("ort", "quiet"), None),
    ("ORT query p50, busy / quiet", "query_p50_ms", ("ort", "busy"), ("ort", "quiet"), None),
    ("pollen engine / ORT query p50, quiet", "query_p50_ms", ("engine", "quiet"), ("ort", "quiet"), None),
    ("pollen engine / ORT docs texts/s, quiet", "docs_texts_per_s", ("engine", "quiet"), ("ort", "quiet"), None),
    ("pollen / pollen engine query p50, quiet", "query_p50_ms", ("pollen", "quiet"), ("engine", "quiet"), None),
]


def derived(rows: list[dict], runs: list[dict]) -> dict:
    out = {}
    for name, metric, a, b, target in RATIOS:
        r = ratio(rows, runs, metric, a, b)
        if r is None or r["value"] is None:
            continue
        if target:
            op, bound = target
            r["target"] = f"{op} {bound}"
            r["met"] = r["value"] <= bound if op == "<=" else r["value"] >= bound
        out[name] = r
    return out


def markdown(rows: list[dict], ratios: dict, skipped: dict, figures: dict) -> str:
    head = ["contender", "condition", *(h for _, _, h, _ in METRICS), "min cosine"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [NAMES[row["contender"]], row["condition"], *(cell(row[m], d) for m, _, _, d in METRICS),
                 f"{row['min_cosine']:.6f}"]
        lines.append("| " + " | ".join(cells) + " |")
    mem = ["| contender | condition | process | PSS MiB | RSS MiB | peak RSS MiB |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        for label, m in row["memory_per_process"].items():
            mem.append(f"| {NAMES[row['contender']]} | {row['condition']} | {label} | {m['pss_mib']:,.0f} | "
                       f"{m['rss_mib']:,.0f} | {m['peak_rss_mib']:,.0f} |")
    rat = ["| ratio | value (per round) | target |", "| --- | --- | --- |"]
    for name, r in ratios.items():
        rounds = ", ".join(f"{v:.2f}" for v in r["per_round"])
        verdict = f"{r['target']}: {'met' if r['met'] else 'NOT met'}" if "target" in r else ""
        rat.append(f"| {name} | {r['value']:.2f} ({rounds}) | {verdict} |")
    s = figures["settings"]
    notes = [f"{figures['device']['cpu']}, {figures['device']['cores']} cores; "
             + ", ".join(f"{k} {v}" for k, v in figures["versions"].items() if v) + f"; {figures['date']}.",
             f"Model {figures['model']}; {s['queries']} queries one at a time, {s['docs']} docs "
             f"({figures['texts']['docs_tokens']} tokens); {s['rounds']} round(s), each quiet and busy; medians "
             "over rounds (min..max). CPU ms / query and docs CPU s: the contender's own processes (pollen: the "
             "server's supervisor and all its children; the others: their child process); client CPU: this "
             "process (the gRPC client for pollen).",
             f"Busy: {figures['load']}.",
             *(f"{NAMES.get(k, k)}: not run ({why})." for k, why in skipped.items())]
    return "\n\n".join([*notes, "\n".join(lines), "Memory after the docs, per process (median over rounds):",
                        "\n".join(mem), "Ratios (of the medians; in brackets round by round):", "\n".join(rat)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", default="pollen,pollen-torch,engine,st,ort,fastembed",
                        help="comma-separated, of pollen, pollen-torch, engine, st, ort, fastembed (default: all; "
                        "fastembed if it imports)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=2, help="background busy processes in the busy condition (0: none)")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--docs", type=int, default=600)
    parser.add_argument("--warmup-queries", type=int, default=20)
    parser.add_argument("--streams", type=int, default=4, help="pollen's docs: EmbedStream streams")
    parser.add_argument("--per-message", type=int, default=16, help="pollen's docs: texts per stream message")
    parser.add_argument("--batch-size", type=int, default=16, help="docs batch of sentence-transformers, ORT, fastembed")
    parser.add_argument("--threads", type=int, default=0, help="ORT and fastembed intra-op threads (0: os.cpu_count())")
    parser.add_argument("--ort-unsorted", action="store_true", help="ORT's docs batches in the given order, unsorted")
    parser.add_argument("--pollen-flag", action="append", default=[],
                        help="a flag for `pollen serve`, repeated: --pollen-flag=--worker-threads=1")
    parser.add_argument("--onnx-dir", default=None, help="where the ONNX exports are kept, ORT's and pollen's "
                        "(default <tmp>/pollen-bench-cpu-onnx)")
    parser.add_argument("--fastembed-site", default=None, help="a folder fastembed is installed in (pip --target)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (10 queries, 32 docs, 1 round, busy 1); writes a file only with --out")
    add_out_argument(parser, "cpu")
    args = parser.parse_args()
    if args.smoke:
        args.queries, args.docs, args.rounds, args.busy, args.warmup_queries = 10, 32, 1, min(args.busy, 1), 5
    keys = [k.strip() for k in args.contenders.split(",") if k.strip()]
    unknown = [k for k in keys if k not in NAMES]
    if unknown:
        parser.error(f"unknown contenders {unknown}; of {list(NAMES)}")

    from tokenizers import Tokenizer

    from pollen.common.model_spec import default_model_path

    t_start = time.perf_counter()
    model_dir = str(default_model_path())
    docs, queries = make_docs(args.docs, seed=1), make_queries(args.queries, seed=2)
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tokenizer.enable_truncation(cc.MAX_LENGTH)
    tokenizer.no_padding()
    texts = {"queries": queries, "docs": docs,
             "docs_tokens": sum(len(e.ids) for e in tokenizer.encode_batch(docs))}

    skipped = {}
    if "fastembed" in keys:
        import importlib.util

        if args.fastembed_site:
            sys.path.insert(0, args.fastembed_site)
        found = importlib.util.find_spec("fastembed") is not None
        if args.fastembed_site:
            sys.path.remove(args.fastembed_site)
        if not found:
            skipped["fastembed"] = "not installed (it would need huggingface_hub<2 here: see --fastembed-site)"
            keys.remove("fastembed")
    onnx = None
    args.onnx_dir = args.onnx_dir or os.path.join(tempfile.gettempdir(), "pollen-bench-cpu-onnx")
    if {"ort", "fastembed"} & set(keys):
        onnx = cc.export_onnx(model_dir, args.onnx_dir)
        print(f"ONNX export: {onnx['path']} ({'reused, stamp matches' if onnx['reused'] else 'exported'})", flush=True)
    if {"pollen", "engine"} & set(keys):  # made once here: every start of theirs finds it
        from pollen.common.model_spec import read_model_spec
        from pollen.common.onnx_cache import pollen_exports

        ours = pollen_exports([read_model_spec(model_dir)], args.onnx_dir)[0]
        if ours.error:
            raise SystemExit(f"pollen's ONNX export failed: {ours.error}")
        print(f"pollen's ONNX export: {ours.path} ({'exported' if ours.made else 'reused'})", flush=True)

    # The reference: sentence-transformers on every text, once.
    ref = cc.ChildContender("reference", "st", {"model_dir": model_dir, "batch_size": 64}).start()
    try:
        reference = {"queries": ref.embed_docs(queries)["vectors"], "docs": ref.embed_docs(docs)["vectors"]}
    finally:
        ref.close()

    conditions = ["quiet", "busy"] if args.busy > 0 else ["quiet"]
    runs = []
    for rnd in range(args.rounds):
        order = keys if rnd % 2 == 0 else keys[::-1]
        for condition in (conditions if rnd % 2 == 0 else conditions[::-1]):
            for key in order:
                if key not in keys:  # skipped in an earlier run
                    continue
                try:
                    run = one_run(key, condition, args, texts, reference, onnx, model_dir)
                except RuntimeError as e:
                    if key != "fastembed":
                        raise
                    skipped["fastembed"] = f"failed: {str(e).strip().splitlines()[-1]}"
                    keys.remove("fastembed")
                    print(f"fastembed: not run ({skipped['fastembed']})", flush=True)
                    continue
                run["round"] = rnd + 1
                runs.append(run)
                print(f"round {rnd + 1} {condition:5} {NAMES[key]:22} query p50 {run['queries']['p50_ms']:7.2f} ms, "
                      f"CPU {run['queries']['cpu_ms_per_query']:6.2f} ms/query, docs {run['docs']['texts_per_s']:7.1f} "
                      f"texts/s, PSS {run['memory']['pss_mib']:6.0f} MiB, min cos {run['min_cosine']:.6f}", flush=True)

    import grpc
    import onnx as onnx_pkg
    import onnxruntime
    import sentence_transformers
    import torch
    import transformers

    rows = summarize(runs, keys, conditions)
    ratios = derived(rows, runs)
    fastembed_version = next((r["info"].get("fastembed") for r in runs if r["contender"] == "fastembed"), None)
    figures = {
        "date": time.strftime("%Y-%m-%d"), "device": machine_details(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "onnxruntime": onnxruntime.__version__, "onnx": onnx_pkg.__version__,
                     "sentence-transformers": sentence_transformers.__version__,
                     "transformers": transformers.__version__, "grpcio": grpc.__version__,
                     "tokenizers": cc._version("tokenizers"), "numpy": np.__version__, "fastembed": fastembed_version},
        "model": "all-MiniLM-L6-v2", "model_dir": model_dir,
        "load": (f"{args.busy} background process(es) each running `{BUSY_CODE}` in Python (a pure-Python busy loop, "
                 "default priority, not pinned), started after the contender's warm-up and stopped after its docs"
                 if args.busy else "none"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "texts": {"queries": len(queries), "docs": len(docs), "docs_tokens": texts["docs_tokens"],
                  "queries_from": "make_docs(n, seed=2), first clause", "docs_from": "make_docs(n, seed=1)",
                  "tokens": f"the model's tokenizer.json, special tokens included, truncation {cc.MAX_LENGTH}"},
        "env": {k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "HF_HUB_OFFLINE")},
        "onnx_export": onnx, "contenders": {k: NAMES[k] for k in keys}, "skipped": skipped,
        "min_cosine_required": MIN_COSINE, "rows": rows, "ratios": ratios, "runs": runs,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    text = markdown(rows, ratios, skipped, figures)
    print(text, flush=True)
    if not args.smoke or args.out:
        write_result("cpu", "cpu", "pollen on the CPU against sentence-transformers, ONNX Runtime and fastembed",
                     text, figures, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
