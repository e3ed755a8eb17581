"""The README's examples work as written: its Python snippet of "Call it" runs against a real server
(the addresses swapped for the test server's), and `pollen embed` writes int8 scales where
docs/api.md says."""
from __future__ import annotations

import contextlib
import io
import pathlib
import re
import subprocess

import numpy as np
import pytest

from tests.conftest import POLLEN, ServerProcess

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--log-level", "WARNING").start()
    yield srv
    assert srv.terminate() == 0


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_call_it_python_snippet_runs(server):
    pytest.importorskip("openai", reason="the snippet calls pollen through the openai package (the test extra)")
    snippets = re.findall(r"```python\n(.*?)```", section("Call it"), re.S)
    assert len(snippets) == 1
    code = snippets[0].replace("127.0.0.1:8080", server.http_listen).replace("127.0.0.1:50051", server.listen)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    lines = printed.getvalue().splitlines()
    assert lines[0].split()[0] == "128" and int(lines[0].split()[1]) > 0  # the OpenAI answer: dims, tokens
    assert lines[1:] == ["(384,)"] * 1_000  # one vector per line, in order


def test_pollen_embed_writes_int8_scales_where_the_docs_say(server, tmp_path):
    named = re.search(r"`-o (\S+\.npy)` puts the scales in `(\S+)`", (REPO / "docs" / "api.md").read_text())
    assert named, "docs/api.md names the int8 scales file"
    out, scales = tmp_path / named[1], tmp_path / named[2]
    done = subprocess.run([POLLEN, "embed", "--server", server.listen, "--encoding", "int8", "--format", "npy",
                           "-o", str(out), "a bee", "a hive"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert np.load(out).shape == (2, 384) and np.load(out).dtype == np.int8
    assert np.load(scales).shape == (2,)
