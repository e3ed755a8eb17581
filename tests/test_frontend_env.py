"""A frontend's malloc thresholds (server/process/supervisor.py FRONTEND_ENV): answer-sized blocks (megabytes
of token vectors, copied out of the ring, into a protobuf message and its serialized bytes) stay in
the heap for reuse instead of being mapped and faulted in anew for every copy. What reads the
variables (glibc) is checked in a child process; that the frontends get them under the user's
environment, as the other FRONTEND_ENV variables, in tests/test_frontend_tokenizer_threads.py."""
from __future__ import annotations

import os
import subprocess
import sys

from pollen.server.process.supervisor import FRONTEND_ENV, FRONTEND_HEAP_KEEP

# Two answers in flight, each a block and its bytes, freed, and again, as a frontend's
# answers come and go; prints the page faults that cost.
_ROUNDS = 20
_BLOCK = 12 << 20
_ANSWERS = f"""
import resource
import numpy as np
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def answers():
    blocks = [np.empty({_BLOCK} // 4, np.float32) for _ in range(2)]
    for b in blocks:
        b.fill(1.0)
    return [b.tobytes() for b in blocks]
answers()
before = faults()
for _ in range({_ROUNDS}):
    answers()
print(faults() - before)
"""


def test_a_frontends_heap_keeps_answer_sized_blocks():
    """Without the thresholds glibc maps blocks of 12 MiB anew once its heap top is trimmed (past
    twice its automatic threshold), faulting their 3,072 pages in each time; with them the rounds
    reuse the heap's pages."""
    assert _BLOCK * 4 <= FRONTEND_HEAP_KEEP  # a round's four blocks fit what the heap keeps
    run = [sys.executable, "-c", _ANSWERS]
    default = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    fresh = int(subprocess.run(run, env=default, capture_output=True, text=True, check=True).stdout)
    kept = int(subprocess.run(run, env={**default, **FRONTEND_ENV}, capture_output=True, text=True,
                              check=True).stdout)
    pages = _ROUNDS * 4 * _BLOCK // 4096
    assert fresh >= pages / 2, (fresh, pages)
    assert kept < fresh / 4, (kept, fresh)
