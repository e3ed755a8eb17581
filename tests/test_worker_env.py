"""A CPU worker's environment (server/config.py CPU_WORKER_ENV), unless the user's sets the same
variables: a short OpenMP spin, so its idle helper threads sleep soon after a batch instead of
spinning through the gap before the next one; and malloc thresholds that keep batch-sized blocks
in the heap instead of mapping and faulting them in anew for every batch. A CUDA worker's
environment is the user's. (The workers' /proc/PID/environ cannot show it: setproctitle writes
the process title over that memory.) What reads the variables (torch's libgomp, glibc) is checked
in a child process; and the CPU's automatic batch budget."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pollen.server.config import CPU_WORKER_ENV, worker_environment


def test_a_cpu_worker_spins_briefly_unless_the_user_says():
    assert worker_environment("cpu", {"PATH": "/bin"}) == {"PATH": "/bin", **CPU_WORKER_ENV}
    assert worker_environment("cpu", {"GOMP_SPINCOUNT": "250000"})["GOMP_SPINCOUNT"] == "250000"
    assert "GOMP_SPINCOUNT" not in worker_environment("cuda", {"PATH": "/bin"})


def test_torchs_openmp_reads_the_spin_count():
    run = [sys.executable, "-c", "import torch; torch.set_num_threads(2); torch.ones(4096, 4096).sum()"]
    bad = subprocess.run(run, env={**os.environ, "GOMP_SPINCOUNT": "lots"}, capture_output=True, text=True)
    good = subprocess.run(run, env={**os.environ, **CPU_WORKER_ENV}, capture_output=True, text=True)
    assert "GOMP_SPINCOUNT" in bad.stderr
    assert "GOMP_SPINCOUNT" not in good.stderr and good.returncode == 0


# Allocates and frees a batch-sized block (32 MiB: over glibc's largest automatic mmap threshold)
# again and again, as a CPU worker's batches do, and prints the page faults that cost.
_ROUNDS = 20
_REUSE = f"""
import resource, torch
ROUNDS = {_ROUNDS}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(8 << 20); del x
before = faults()
for _ in range(ROUNDS):
    x = torch.ones(8 << 20); del x
print(faults() - before)
"""


def test_a_cpu_workers_heap_keeps_batch_sized_blocks():
    """glibc reads the thresholds: without them every 32 MiB block is mapped and faulted in anew
    (8,192 pages each time); with them the heap keeps the pages, and most rounds reuse them (torch
    allocates aligned blocks, which glibc's heap does not always fit where the last one was)."""
    run = [sys.executable, "-c", _REUSE]
    default = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    fresh = int(subprocess.run(run, env=default, capture_output=True, text=True, check=True).stdout)
    kept = int(subprocess.run(run, env={**default, **CPU_WORKER_ENV}, capture_output=True, text=True,
                              check=True).stdout)
    assert fresh >= _ROUNDS * 8192 * 0.9, fresh
    assert kept < fresh / 2, (kept, fresh)


def test_auto_batch_tokens_by_device():
    import dataclasses

    from pollen.common.model_spec import default_model_path, read_model_spec
    from pollen.server.config import ServeConfig
    from pollen.server.process.app import check_limits

    spec = read_model_spec(default_model_path())
    for threads in (1, 2, 3):  # on the CPU, 1,024 tokens per worker thread: each thread's piece holds several texts
        cfg = ServeConfig(worker_threads=threads)
        check_limits(cfg, [spec])
        assert cfg.device == "cpu" and cfg.max_batch_tokens == 1024 * threads
        assert cfg.bulk_batch_tokens == min(1024 * threads, max(1024, 512 * threads))  # what a query may wait behind
    cfg = ServeConfig(worker_threads=8)
    check_limits(cfg, [spec])
    assert (cfg.max_batch_tokens, cfg.bulk_batch_tokens) == (8192, 4096)
    long = dataclasses.replace(spec, max_tokens=4096)  # one text must always fit a batch
    cfg = ServeConfig(worker_threads=2)
    check_limits(cfg, [spec, long])
    assert cfg.max_batch_tokens == 4096
    with pytest.raises(ValueError, match="--max-batch-tokens 2048 is below the model's limit of 4096"):
        check_limits(ServeConfig(max_batch_tokens=2048), [long])


def test_server_and_bulk_embedder_take_the_same_automatic_values():
    """--max-batch-tokens and --dtype auto have one home (common/defaults.py): `pollen serve` and the
    bulk embedder get the same value for the same machine and model (the CUDA engine's default,
    made in code, takes it from there too)."""
    import torch

    from pollen.bulk.embedder import BulkEmbedder
    from pollen.common.model_spec import default_model_path, read_model_spec
    from pollen.server.config import ServeConfig
    from pollen.server.process.app import check_limits

    spec = read_model_spec(default_model_path())
    for threads in (1, 3):
        cfg = ServeConfig(worker_threads=threads)
        check_limits(cfg, [spec])
        bulk = BulkEmbedder(threads=threads, cpu_engine="torch")
        assert bulk.max_batch_tokens == cfg.max_batch_tokens == 1024 * threads
        assert cfg.worker_dtype() == "float32" and next(bulk.engine.model.parameters()).dtype == torch.float32


def test_tokenizer_threads_auto_on_cpu_and_as_given():
    from pollen.server.config import ServeConfig

    assert ServeConfig().tokenizer_threads == 2  # auto on the CPU
    assert ServeConfig(tokenizer_threads=5).tokenizer_threads == 5
    with pytest.raises(ValueError, match="--tokenizer-threads must be auto or at least 1"):
        ServeConfig(tokenizer_threads=-1)
