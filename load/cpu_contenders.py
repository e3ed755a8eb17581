"""The contenders of load/bench_cpu.py, and how their processes' CPU time and memory are read.

Each contender has `start()`, `pids()` (the processes that do its work, measured from outside by
/proc), `embed_queries(texts)` (one text per call, each call timed), `embed_docs(texts)` (in batches,
timed as a whole) and `close()`. Both embed methods answer a dict: `vectors` (float32, L2-normalized,
one row per text, in order), `seconds` (wall time of the workload) and, for queries, `latencies_ms`.

  pollen                 `pollen serve` (tests.conftest.ServerProcess) on its defaults plus the
                         flags given (--cpu-engine torch: its torch engine); queries by unary Embed
                         from this process, docs over EmbedStream on several streams, each on its own
                         connection. Its processes: the server's supervisor and every descendant
                         (frontends, workers).
  sentence-transformers  SentenceTransformer(folder, device="cpu") in a child process: a query is
                         encode([text]); docs are encode(docs, batch_size=B) (which sorts by length).
  ONNX Runtime           the same checkpoint exported to ONNX (export_onnx), an InferenceSession on the
                         CPU provider in a child process, tokenized by `tokenizers` from the folder's
                         tokenizer.json (truncation 256, padding per batch), mean-pooled over the
                         attention mask and normalized in numpy; docs in batches of B, sorted by length
                         first as sentence-transformers does (or in the given order: sort=False).
  fastembed              fastembed's TextEmbedding("sentence-transformers/all-MiniLM-L6-v2") on the same
                         ONNX export (specific_model_path: fastembed would otherwise download Qdrant's
                         export from the Hub), in a child process, when fastembed imports.

The child processes speak pickle over their stdin and stdout (the child's library prints go to its
stderr), so this process's imports (grpc, pytest) never weigh on a child's memory.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

from load import library_defaults
from pollen.common import onnx_cache

REPO = pathlib.Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
MAX_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length (sentence_bert_config.json)
FASTEMBED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


# --- processes: CPU seconds and memory, read from /proc ---------------------------------------------

def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (psutil when installed, else /proc/<pid>/task/*/children)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            return [pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if not os.path.exists(f"/proc/{p}"):
            continue
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def cpu_ticks(pids: list[int]) -> dict[int, int]:
    """utime + stime of each process (all its threads), in clock ticks."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[pid] = int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5), counted after "(comm)"
    return out


def cpu_seconds_between(before: dict[int, int], after: dict[int, int]) -> float:
    """CPU seconds the processes used between two cpu_ticks; a process born in between counts from 0
    (one that died in between is lost: none of the contenders' processes do)."""
    return sum(t - before.get(pid, 0) for pid, t in after.items()) / CLK_TCK


def process_label(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return str(pid)
    if not argv:
        return str(pid)
    if argv[0].startswith("pollen-"):  # a pollen child's process title: pollen-worker[0] cpu MODEL
        return argv[0].split()[0]
    if len(argv) > 1 and os.path.basename(argv[1]) == "pollen":
        return "pollen serve (supervisor)"
    return os.path.basename(argv[0])


def memory(pids: list[int], labels: dict[int, str] | None = None) -> dict:
    """PSS, RSS (/proc/<pid>/smaps_rollup) and peak RSS (VmHWM) of each process, in MiB, and the totals;
    each process named by `labels` or else its title or command."""
    per = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                kb = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if v.strip().endswith("kB")}
            with open(f"/proc/{pid}/status") as f:
                hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        label = (labels or {}).get(pid) or process_label(pid)
        while label in per:
            label += "'"
        per[label] = {"pid": pid, "pss_mib": round(kb.get("Pss", 0) / 1024, 1), "rss_mib": round(kb.get("Rss", 0) / 1024, 1),
                      "peak_rss_mib": round(hwm / 1024, 1)}
    return {"processes": per, "pss_mib": round(sum(p["pss_mib"] for p in per.values()), 1),
            "rss_mib": round(sum(p["rss_mib"] for p in per.values()), 1)}


# --- the ONNX export -------------------------------------------------------------------------------

EXPORT_VERSION = 1  # raise when _export changes: every cached export is then stale
OPSET = 17


def _version(name: str) -> str | None:
    return onnx_cache.versions(name)[name]


def export_onnx(model_dir: str, folder: str | None = None) -> dict:
    """The checkpoint as model.onnx, with the folder's tokenizer files beside it, in pollen's cache
    of exports (common/onnx_cache.py) at `folder` (default: <tmp>/pollen-bench-cpu-onnx): keyed by
    the checkpoint's weights and config and the exporter with its torch, transformers and onnx
    versions, so a stale export is never used. Answers its stamp, the path and whether it was reused."""
    model = pathlib.Path(model_dir)
    maker = {"exporter": "torch.onnx.export(dynamo=False) of transformers.AutoModel (eager attention), "
                         "inputs input_ids/attention_mask/token_type_ids, output last_hidden_state, "
                         "batch and sequence axes dynamic",
             "export_version": EXPORT_VERSION, "opset": OPSET, **onnx_cache.versions("torch", "transformers", "onnx")}
    place = onnx_cache.slot(folder or os.path.join(tempfile.gettempdir(), "pollen-bench-cpu-onnx"), maker,
                            [str(model / "config.json"), str(model / "model.safetensors")])

    def make(works: list[str]) -> list[str | None]:
        subprocess.run([sys.executable, "-c", "import sys; from load.cpu_contenders import _export; _export(*sys.argv[1:])",
                        str(model), os.path.join(works[0], "model.onnx")], cwd=REPO, check=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
        for name in TOKENIZER_FILES:
            if (model / name).exists():
                shutil.copyfile(model / name, os.path.join(works[0], name))
        return [None]

    export = onnx_cache.fill([place], make)[0]
    with open(os.path.join(export.path, onnx_cache.STAMP)) as f:
        stamp = json.load(f)
    return {**stamp, "path": os.path.join(export.path, "model.onnx"), "reused": not export.made}


def _export(model_dir: str, path: str) -> None:
    """In a child process (torch stays out of the benchmark's own): the export itself, then onnx's checker."""
    import warnings

    import onnx
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()

    class Hidden(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    ids = torch.randint(1000, 2000, (2, 11))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(Hidden(model), (ids, torch.ones_like(ids), torch.zeros_like(ids)), path, dynamo=False,
                          input_names=names, output_names=["last_hidden_state"], opset_version=OPSET,
                          dynamic_axes={n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]})
    onnx.checker.check_model(path)


# --- engines, each run in a child process ------------------------------------------------------------

def _timed_queries(embed_one, texts: list[str]) -> dict:
    rows, latencies = [], []
    t0 = time.perf_counter()
    for text in texts:
        t = time.perf_counter()
        rows.append(embed_one(text))
        latencies.append((time.perf_counter() - t) * 1e3)
    return {"vectors": np.concatenate(rows).astype(np.float32), "seconds": time.perf_counter() - t0,
            "latencies_ms": latencies}


def _timed_docs(embed_all, texts: list[str]) -> dict:
    t0 = time.perf_counter()
    vectors = embed_all(texts)
    return {"vectors": np.asarray(vectors, dtype=np.float32), "seconds": time.perf_counter() - t0}


class STEngine:
    def __init__(self, model_dir: str, batch_size: int):
        import sentence_transformers
        import torch
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(model_dir, device="cpu")
        self.batch_size = batch_size
        self.info = {"sentence_transformers": sentence_transformers.__version__, "torch": torch.__version__,
                     "torch_threads": torch.get_num_threads(), "max_seq_length": self.model.max_seq_length,
                     "docs_batch": batch_size}

    def _encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        return self.model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                                 show_progress_bar=False)

    def embed_queries(self, texts: list[str]) -> dict:
        return _timed_queries(lambda t: self._encode([t], 1), texts)

    def embed_docs(self, texts: list[str]) -> dict:
        return _timed_docs(lambda ts: self._encode(ts, self.batch_size), texts)


class ORTEngine:
    def __init__(self, onnx_path: str, tokenizer_path: str, batch_size: int, threads: int, sort: bool = True):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.tokenizer.enable_truncation(MAX_LENGTH)
        self.tokenizer.enable_padding()  # to the longest text of each batch (the file pads to 128)
        self.batch_size, self.sort = batch_size, sort
        self.info = {"onnxruntime": ort.__version__, "providers": self.session.get_providers(),
                     "intra_op_threads": threads, "graph_optimization": "ORT_ENABLE_ALL", "docs_batch": batch_size,
                     "truncation": MAX_LENGTH,
                     "docs_order": "sorted by length, longest first (as sentence-transformers' encode)" if sort
                     else "as given"}

    def _embed(self, texts: list[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": mask,
                "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64)}
        hidden = self.session.run(None, {k: v for k, v in feed.items() if k in self.inputs})[0]
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)

    def embed_queries(self, texts: list[str]) -> dict:
        return _timed_queries(lambda t: self._embed([t]), texts)

    def _embed_all(self, texts: list[str]) -> np.ndarray:
        order = np.argsort([-len(t) for t in texts], kind="stable") if self.sort else np.arange(len(texts))
        ordered = [texts[i] for i in order]
        rows = np.concatenate([self._embed(ordered[i:i + self.batch_size])
                               for i in range(0, len(ordered), self.batch_size)])
        out = np.empty_like(rows)
        out[order] = rows  # back in the texts' order
        return out

    def embed_docs(self, texts: list[str]) -> dict:
        return _timed_docs(self._embed_all, texts)


class FastEmbedEngine:
    def __init__(self, onnx_dir: str, batch_size: int, threads: int):
        import fastembed
        from fastembed import TextEmbedding

        self.model = TextEmbedding(FASTEMBED_MODEL, specific_model_path=onnx_dir, threads=threads)
        inner = getattr(self.model, "model", None)
        tokenizer = getattr(inner, "tokenizer", None)
        truncation = None
        if tokenizer is not None:  # fastembed reads 512 from the config; the model was trained at 256
            tokenizer.enable_truncation(MAX_LENGTH)
            truncation = MAX_LENGTH
        self.batch_size = batch_size
        self.info = {"fastembed": fastembed.__version__, "model": FASTEMBED_MODEL, "onnx": "this benchmark's export",
                     "threads": threads, "docs_batch": batch_size, "truncation": truncation}

    def _embed(self, texts: list[str], batch_size: int) -> np.ndarray:
        return np.stack(list(self.model.embed(texts, batch_size=batch_size)))

    def embed_queries(self, texts: list[str]) -> dict:
        return _timed_queries(lambda t: self._embed([t], 1), texts)

    def embed_docs(self, texts: list[str]) -> dict:
        return _timed_docs(lambda ts: self._embed(ts, self.batch_size), texts)


class PollenEngine:
    """pollen's CPU engine without the server: bulk/'s BulkEmbedder (the server's tokenizer, packing
    and engine, chosen as `pollen serve --cpu-engine` chooses, with the worker's thread choice) in
    this process, with the worker's environment (the parent passes CPU_WORKER_ENV) and the server's
    CPU batch budget and threads. What `pollen serve` adds to it is the trip through the client,
    gRPC, the frontend and the rings."""

    def __init__(self, model_dir: str, batch_tokens: int, threads: int, cpu_engine: str = "auto",
                 onnx_cache: str | None = None):
        from pollen.bulk.embedder import BulkEmbedder
        from pollen.server.config import CPU_WORKER_ENV

        self.embedder = BulkEmbedder(model_dir, device="cpu", max_batch_tokens=batch_tokens, threads=threads,
                                     cpu_engine=cpu_engine, onnx_cache=onnx_cache)
        engine = type(self.embedder.engine).__name__
        self.info = {"engine": engine, "threads": threads, "batch_tokens": batch_tokens,
                     **engine_versions(engine),
                     "environment": {k: os.environ.get(k) for k in sorted(CPU_WORKER_ENV)},
                     "docs_order": "as given, packed into batches of at most batch_tokens (the server's CPU default)"}

    def embed_queries(self, texts: list[str]) -> dict:
        return _timed_queries(lambda t: self.embedder.embed([t]), texts)

    def embed_docs(self, texts: list[str]) -> dict:
        return _timed_docs(self.embedder.embed, texts)


def engine_versions(engine: str) -> dict:
    """The versions of what runs an engine of that class."""
    return onnx_cache.versions("onnxruntime" if engine == "OnnxEngine" else "torch")


ENGINES = {"st": STEngine, "ort": ORTEngine, "fastembed": FastEmbedEngine, "pollen-engine": PollenEngine}


def child_main() -> None:
    """A child's loop: the spec, then ("embed_queries" | "embed_docs", texts) until None."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the answers
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer

    def send(message) -> None:
        pickle.dump(message, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()

    spec = pickle.load(requests)
    sys.path[:0] = spec.get("sys_path", [])
    try:
        engine = ENGINES[spec["engine"]](**spec["kwargs"])
    except BaseException as e:  # the parent says why the contender did not run
        send(("error", f"{type(e).__name__}: {e}"))
        return
    send(("ready", engine.info))
    while (request := pickle.load(requests)) is not None:
        method, texts = request
        try:
            send(("ok", getattr(engine, method)(texts)))
        except BaseException:
            send(("error", traceback.format_exc()))


class ChildContender:
    """An engine in a child process of its own; the parent reads the child's CPU time and memory."""

    def __init__(self, key: str, engine: str, kwargs: dict, sys_path: list[str] | None = None,
                 env: dict[str, str] | None = None, library: bool = True):
        self.key, self.engine, self.kwargs, self.sys_path = key, engine, kwargs, sys_path or []
        self.env = env or {}  # under the parent's environment: a variable the user set wins
        self.library = library  # a library a user would otherwise run: on its defaults (load/library_defaults.py)
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self) -> ChildContender:
        env = {**self.env, **os.environ}
        if self.library:
            env.pop(library_defaults.VARIABLE, None)
        if self.sys_path:
            env["PYTHONPATH"] = os.pathsep.join([*self.sys_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.proc = subprocess.Popen([sys.executable, "-c", "from load.cpu_contenders import child_main; child_main()"],
                                     cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._send({"engine": self.engine, "kwargs": self.kwargs, "sys_path": self.sys_path})
        kind, info = self._receive()
        if kind != "ready":
            self.close()
            raise RuntimeError(info)
        self.info = info
        return self

    def _send(self, message) -> None:
        pickle.dump(message, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.flush()

    def _receive(self):
        try:
            return pickle.load(self.proc.stdout)
        except EOFError:
            raise RuntimeError(f"{self.key}: its process exited with {self.proc.wait()}") from None

    def _call(self, method: str, texts: list[str]) -> dict:
        self._send((method, texts))
        kind, answer = self._receive()
        if kind != "ok":
            raise RuntimeError(f"{self.key}.{method} failed:\n{answer}")
        return answer

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid)

    def labels(self) -> dict[int, str]:
        return {self.proc.pid: f"{self.engine} child process"}

    def embed_queries(self, texts: list[str]) -> dict:
        return self._call("embed_queries", texts)

    def embed_docs(self, texts: list[str]) -> dict:
        return self._call("embed_docs", texts)

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self._send(None)
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# --- pollen --------------------------------------------------------------------------------------

class PollenContender:
    """`pollen serve`, driven over gRPC from this process."""

    def __init__(self, flags: list[str], streams: int, per_message: int, key: str = "pollen"):
        self.key = key
        self.flags, self.streams, self.per_message = list(flags), streams, per_message
        self.server = None
        self.channel = None
        self.info: dict = {}

    def start(self) -> PollenContender:
        import grpc

        from pollen.v1 import embedder_pb2_grpc as pb_grpc
        from tests.conftest import ServerProcess

        self.server = ServerProcess("--log-level", "WARNING", *self.flags).start(timeout=120)
        self.channel = grpc.insecure_channel(self.server.listen)
        self.stub = pb_grpc.EmbedderStub(self.channel)
        self.info = {"flags": ["--log-level", "WARNING", *self.flags], "startup_s": round(self.server.started_in_s, 2),
                     "queries": "unary Embed, one text, normalize, TRUNCATE_END, one channel",
                     "docs": f"EmbedStream, {self.streams} streams (a connection each) x {self.per_message} texts per message",
                     "grpcio": grpc.__version__}
        return self

    def pids(self) -> list[int]:
        return process_tree(self.server.pid)

    def labels(self) -> dict[int, str]:
        return {self.server.pid: "pollen serve (supervisor)"}

    def embed_queries(self, texts: list[str]) -> dict:
        from pollen.v1 import embedder_pb2 as pb

        def one(text: str) -> np.ndarray:
            r = self.stub.Embed(pb.EmbedRequest(texts=[text], normalize=True, truncate=pb.TRUNCATE_END), timeout=60)
            return _vectors(r)

        return _timed_queries(one, texts)

    def embed_docs(self, texts: list[str]) -> dict:
        return asyncio.run(self._docs(texts))

    async def _docs(self, texts: list[str]) -> dict:
        import grpc

        from pollen.v1 import embedder_pb2 as pb
        from pollen.v1 import embedder_pb2_grpc as pb_grpc

        chunks = [texts[i:i + self.per_message] for i in range(0, len(texts), self.per_message)]
        answers: dict[int, np.ndarray] = {}
        tokens = 0
        channels = [grpc.aio.insecure_channel(self.server.listen) for _ in range(self.streams)]
        try:
            await asyncio.gather(*(c.channel_ready() for c in channels))

            async def one_stream(channel, part: list[int]) -> None:
                nonlocal tokens

                async def requests():
                    for i in part:
                        yield pb.EmbedRequest(id=str(i), texts=chunks[i], normalize=True, truncate=pb.TRUNCATE_END)

                async for answer in pb_grpc.EmbedderStub(channel).EmbedStream(requests(), timeout=600):
                    answers[int(answer.id)] = _vectors(answer)
                    tokens += answer.usage.prompt_tokens

            t0 = time.perf_counter()
            await asyncio.gather(*(one_stream(c, list(range(s, len(chunks), self.streams)))
                                   for s, c in enumerate(channels)))
            seconds = time.perf_counter() - t0
        finally:
            await asyncio.gather(*(c.close() for c in channels))
        return {"vectors": np.concatenate([answers[i] for i in range(len(chunks))]), "seconds": seconds,
                "server_tokens": tokens}

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.server is not None:
            rc = self.server.terminate()
            if rc != 0:
                raise RuntimeError(f"pollen serve exited with {rc}")


def _vectors(response) -> np.ndarray:
    if response.HasField("error"):
        raise RuntimeError(f"pollen answered an error: {response.error.message}")
    return np.frombuffer(response.embeddings, dtype="<f4").reshape(response.rows, response.dims)
