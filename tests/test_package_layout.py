"""One installed package: `pollen.*` imports from anywhere, the repository's folders never do,
the frontend stays free of torch, and workers start as `python -m pollen.worker`."""
from __future__ import annotations

import subprocess
import sys

import pytest

FRONTEND_MODULES = ("pollen.server.process.app", "pollen.server.grpc_api.service", "pollen.server.pipeline.admission",
                    "pollen.server.config", "pollen.server.cli", "pollen.server.http_api.door",
                    "pollen.server.process.supervisor", "pollen.server.pipeline.channel", "pollen.server.pipeline.router", "pollen.server.process.frontend", "pollen.server.pipeline.tokenizer", "pollen.client")


def run_python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["server", "worker", "shared_mem", "pollen_client", "client", "common", "bulk"])
def test_repository_folders_are_not_top_level_modules_outside_the_checkout(tmp_path, name):
    result = run_python(f"import {name}", cwd=tmp_path)
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, result.stderr


def test_pollen_parts_import_from_outside_the_checkout(tmp_path):
    code = ("import pollen.server.process.app, pollen.worker.main, pollen.shared_mem.ring, pollen.client, "
            "pollen.common.encodings, pollen.v1.embedder_pb2")
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_the_frontend_never_imports_torch(tmp_path):
    code = (f"import sys\nfor m in {FRONTEND_MODULES!r}: __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers'))\n"
            "assert not bad, bad")
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_the_worker_runs_as_python_m_pollen_worker(tmp_path):
    # The server starts each worker this way (its process title then replaces the command line).
    result = subprocess.run([sys.executable, "-m", "pollen.worker"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "usage: python -m pollen.worker" in result.stderr, result.stderr
