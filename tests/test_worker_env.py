"""A CPU worker starts with a short OpenMP spin (server/config.py CPU_WORKER_ENV), so its idle
helper threads sleep soon after a batch instead of spinning through the gap before the next one;
a value the user's environment sets wins, and a CUDA worker's environment is the user's. (The
workers' /proc/PID/environ cannot show it: setproctitle writes the process title over that
memory.) The libgomp that torch loads reads the variable: a bad value makes it complain at
start-up, which a child process shows."""
from __future__ import annotations

import os
import subprocess
import sys

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
