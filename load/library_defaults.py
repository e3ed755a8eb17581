"""The library a benchmark compares pollen against runs as its users run it.

pollen's tests and GPU scripts set TOKENIZERS_PARALLELISM=false (tests/conftest.py,
load/run_gpu.sh): pollen's frontends tokenize on a thread pool of their own, and the variable keeps
the tokenizers library's pool from starting beside it. A user of sentence-transformers or
transformers leaves it unset, so their tokenizer encodes a batch on every core; a reference that
tokenizes inside its timed loop with the variable set would run slower than a user's.
"""
from __future__ import annotations

import contextlib
import os

VARIABLE = "TOKENIZERS_PARALLELISM"


@contextlib.contextmanager
def library_defaults():
    """The block runs with the tokenizers library's own thread pool on (its default); the
    variable is restored after. The library reads the variable at each batch it encodes."""
    saved = os.environ.pop(VARIABLE, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[VARIABLE] = saved


# How the results files say it.
NOTE = ("The reference runs with the tokenizers library's defaults (its thread pool on, "
        "TOKENIZERS_PARALLELISM unset), as its users run it.")
