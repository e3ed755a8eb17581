"""./pollenw, the README's two commands: the README's first section gives exactly them, CI runs the
second, and once the environment is made a call just starts pollen with the flags given. (Making
the environment downloads torch: the clean-clone run of .ci/run is that check.)"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

from tests.conftest import POLLEN, free_port

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    readme = (REPO / "README.md").read_text()
    first = readme.split("\n## ", 2)[1]
    assert first.startswith("Start\n")
    commands = re.findall(r"```sh\n(.*?)```", first, re.S)
    assert [line.split("#")[0].strip() for line in commands[0].splitlines()] == ["./pollenw serve", "./pollenw test"]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "./pollenw test"


def test_a_made_environment_just_starts_pollen_with_the_flags_given(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    os.symlink(POLLEN, venv / "bin" / "pollen")
    checksum = subprocess.run(["cksum"], stdin=open(REPO / "pyproject.toml"), capture_output=True, text=True,
                              check=True).stdout.split()[0]
    (venv / ".pollenw").write_text(f"{checksum} test\n")
    http = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([str(REPO / "pollenw"), "serve", "--listen", f"127.0.0.1:{free_port()}",
                             "--http-listen", http], env={**os.environ, "POLLEN_VENV": str(venv)},
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline, status = time.monotonic() + 60, None
        while status != 200 and time.monotonic() < deadline and proc.poll() is None:
            try:
                status = urllib.request.urlopen(f"http://{http}/health", timeout=2).status
            except OSError:
                time.sleep(0.2)
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "pollenw:" not in proc.stderr.read()  # nothing was installed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
