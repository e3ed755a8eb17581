"""A process's Python profile from py-spy (the `profile` extra): recorded while a benchmark runs,
summarized as the functions with the most samples.

    python load/pyspy_profile.py FILE      # the summary of a recorded profile (collapsed stacks)
"""
from __future__ import annotations

import collections
import shutil
import subprocess
import sys


def record_profile(pid: int, seconds: float, path: str, native: bool = False) -> subprocess.Popen:
    """py-spy on `pid` for `seconds`, collapsed stacks into `path` (py-spy: the `profile` extra).
    `native` adds the C frames under the Python ones (grpc's Cython core, uvloop, protobuf); py-spy
    must then pause the process at each sample, so the run is slower while it records."""
    command = [shutil.which("py-spy") or "py-spy", "record", "--pid", str(pid), "--duration",
               str(max(1, int(seconds))), "--rate", "250", "--format", "raw", "--output", path]
    command += ["--native"] if native else ["--nonblocking"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def summarize_profile(path: str, top: int = 25) -> str:
    """The functions with the most samples: their own (leaf) share and their inclusive share."""
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        n, frames = int(count), stack.split(";")
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    rows = [f"{total} samples", "", "| own % | all % | function |", "| ---: | ---: | --- |"]
    for frame, n in own.most_common(top):
        rows.append(f"| {100 * n / total:.1f} | {100 * inclusive[frame] / total:.1f} | `{frame}` |")
    rows += ["", "| all % | function (inclusive) |", "| ---: | --- |"]
    for frame, n in inclusive.most_common(top):
        rows.append(f"| {100 * n / total:.1f} | `{frame}` |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(summarize_profile(sys.argv[1]), end="")
