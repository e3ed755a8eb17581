"""How a child process of the server starts: `python -m <module> '<its config as JSON>'`, then
`bootstrap` ties it to the supervisor, to its cores and to its name."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

import setproctitle

PR_SET_PDEATHSIG = 1


def config_from_argv(cls, argv: list[str] | None, module: str):
    """`cls` built from the one argument (its to_json()); exit 2 with a usage line without it."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} '<{cls.__name__} as JSON>' (the server starts these)", file=sys.stderr)
        raise SystemExit(2)
    return cls(**json.loads(argv[0]))


def bootstrap(title: str, cpu_cores: list[int], ignore: tuple[int, ...]) -> None:
    """Have Linux SIGKILL us when the supervisor goes (no orphan holds a port or a device), ignore
    the signals in `ignore` (the supervisor says when to stop), run on `cpu_cores` (empty: as
    inherited) and show `title` in the process list."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the closed control socket and the worker's parent-pid check still end us
    for sig in ignore:
        signal.signal(sig, signal.SIG_IGN)
    if cpu_cores:
        os.sched_setaffinity(0, cpu_cores)
    setproctitle.setproctitle(title)
