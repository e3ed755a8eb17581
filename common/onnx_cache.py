"""ONNX exports kept on disk: made once per checkpoint and exporter, found again by every later start.

An export lives in a folder of the cache named by its key, the sha256 of

  - what the export reads: the checkpoint's files (its weights, config.json, modules.json and the
    Dense modules' files), by content, so a changed checkpoint is exported again, wherever it lies;
  - what makes it: the exporter, its format version (EXPORT_VERSION, raised whenever the graph it
    writes changes) and the versions of the packages that write and read it (torch, onnx,
    onnxruntime, pollen), and the options that shape the graph (the task, whose head it holds).

A folder appears whole or not at all: the export writes into a temporary folder beside it, which
is renamed into place once every file and the stamp are written. Two starts that export the same
checkpoint at once each write their own; the first rename wins and the other start takes the
winner's folder. A read-only model directory is only read; the cache (--onnx-cache, default
$XDG_CACHE_HOME/pollen/onnx, else ~/.cache/pollen/onnx) must be writable for a first export.
The cache holds one export per checkpoint (by content), task and set of versions, and pollen
removes none: a folder no start names any more is deleted by hand (each holds the model's float32
weights and a stamp.json that names the checkpoint it was made from).
Nothing here imports torch or ONNX Runtime: the supervisor computes keys, the export runs in a
process of its own.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from pollen.common.model_spec import ModelSpec, weight_files

# pollen's own export (worker/export.py): its files, their opset, and its format's version.
ENCODER_FILE, HEAD_FILE = "encoder.onnx", "head.onnx"
OPSET = 17
EXPORT_VERSION = 1
STAMP = "stamp.json"  # what the folder holds and how it was made, for people; its presence marks a whole folder


@dataclasses.dataclass(frozen=True, slots=True)
class Export:
    path: str                # the export's folder ("" where it failed)
    made: bool = False       # exported by this call (else found in the cache)
    seconds: float = 0.0     # what the export took (0 when found)
    error: str | None = None  # why it failed


def default_folder() -> str:
    """The cache where none is named: POLLEN_ONNX_CACHE (--onnx-cache's variable, so that `pollen
    bulk` and BulkEmbedder share the server's), else $XDG_CACHE_HOME/pollen/onnx, else
    ~/.cache/pollen/onnx."""
    if os.environ.get("POLLEN_ONNX_CACHE"):
        return os.environ["POLLEN_ONNX_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pollen", "onnx")


def versions(*names: str) -> dict[str, str | None]:
    """Installed versions of the named distributions (None for one not installed), read without
    importing them."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {name: version(name) for name in names}


def digest(files: list[str]) -> str:
    """sha256 over each file's name (relative to the first's folder), size and contents."""
    h = hashlib.sha256()
    root = os.path.dirname(files[0]) if files else ""
    for file in files:
        h.update(f"{os.path.relpath(file, root)}\0{os.path.getsize(file)}\0".encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """An export's place in the cache: the folder it is (or will be) in, and what its stamp records."""

    path: str
    stamp: dict

    @property
    def found(self) -> bool:
        return os.path.isfile(os.path.join(self.path, STAMP))


def slot(folder: str, maker: dict, files: list[str]) -> Slot:
    """The place in the cache `folder` of the export keyed by `maker` (what makes it: exporter,
    versions, options; JSON-able) and the contents of `files`."""
    key = hashlib.sha256(json.dumps(maker, sort_keys=True).encode() + digest(files).encode()).hexdigest()[:32]
    return Slot(os.path.join(folder, key), {**maker, "files": [os.path.abspath(f) for f in files]})


def fill(slots: list[Slot], make: Callable[[list[str]], list[str | None]]) -> list[Export]:
    """Each slot's export: found in the cache, or made by one make(folders) call that fills a
    temporary folder beside each missing one and says, for each, why it failed (None where it did
    not); each made folder is then renamed into place (module docstring)."""
    missing = [s for s in slots if not s.found]
    works, done = [], {}
    try:
        for s in missing:
            os.makedirs(os.path.dirname(s.path), exist_ok=True)
            works.append(tempfile.mkdtemp(prefix=f".{os.path.basename(s.path)}.", dir=os.path.dirname(s.path)))
        started = time.perf_counter()
        errors = make(works) if missing else []
        seconds = time.perf_counter() - started
        for s, work, error in zip(missing, works, errors):
            done[s.path] = (Export("", error=error) if error else
                            Export(s.path, _place(s, work, seconds), seconds))
    finally:
        for work in works:
            shutil.rmtree(work, ignore_errors=True)  # gone already where a rename took it
    return [done.get(s.path) or Export(s.path) for s in slots]


def _place(s: Slot, work: str, seconds: float) -> bool:
    """The made folder `work` renamed into the slot, stamped; False where another start put the same
    export there first (then theirs serves)."""
    with open(os.path.join(work, STAMP), "w", encoding="utf-8") as f:
        json.dump({**s.stamp, "seconds": round(seconds, 1), "made": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=1)
    readable(work)
    try:
        os.rename(work, s.path)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not s.found:
            raise
        return False
    return True


def readable(work: str) -> None:
    """The folder and its files as the umask makes them: mkdtemp's folder, and the data files onnx
    writes, are their maker's alone, and a cache may serve the other users of the machine."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(work, 0o777 & ~mask)
    for name in os.listdir(work):
        os.chmod(os.path.join(work, name), 0o666 & ~mask)


def checkpoint_files(spec: ModelSpec) -> list[str]:
    """What pollen's export reads of the checkpoint: config.json, the weights (and their index),
    modules.json and each Dense module's config and weights."""
    path = spec.path
    files = [os.path.join(path, "config.json"), *weight_files(path)]
    for name in ("model.safetensors.index.json", "modules.json"):
        if os.path.isfile(os.path.join(path, name)):
            files.append(os.path.join(path, name))
    for dense in spec.dense:
        files += [os.path.join(dense.path, "config.json"), dense.weights]
    return files


def pollen_exports(specs: list[ModelSpec], folder: str,
                   announce: Callable[[list[ModelSpec]], None] | None = None) -> list[Export]:
    """pollen's own export of each model (worker/export.py), from the cache in `folder`: those it
    lacks are made by one child process (torch is imported once for all), after announce(their
    specs); a model whose export fails has the reason in its Export.error. OSError where the cache
    cannot be written."""
    versions_now = versions("pollen", "torch", "onnx", "onnxruntime")
    slots = [slot(folder, {"exporter": "pollen.worker.export", "export_version": EXPORT_VERSION, "opset": OPSET,
                           "task": spec.task, **versions_now}, checkpoint_files(spec)) for spec in specs]
    missing = [spec for spec, s in zip(specs, slots) if not s.found]

    def make(works: list[str]) -> list[str | None]:
        if announce is not None:
            announce(missing)
        jobs = [{"model": spec.path, "out": work, "task": spec.task} for spec, work in zip(missing, works)]
        run = subprocess.run([sys.executable, "-m", "pollen.worker.export", json.dumps(jobs)],
                             capture_output=True, text=True)
        said = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        if run.returncode != 0 or len(said) != len(jobs):  # it died before it said so for each
            last = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
            return [f"the export process failed: {last}"] * len(jobs)
        return [answer.get("error") for answer in said]

    return fill(slots, make)
