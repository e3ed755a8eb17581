"""`pollen embed` as a user runs it, against the real server."""
from __future__ import annotations

import json
import subprocess

import numpy as np

from pollen.v1 import embedder_pb2 as pb
from tests.conftest import POLLEN, vectors


def pollen_embed(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([POLLEN, "embed", *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_json_equals_grpc(server, stub):
    done = pollen_embed("hello there", "東京 🙂", "--server", server.listen)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    want = vectors(stub.Embed(pb.EmbedRequest(texts=["hello there", "東京 🙂"], normalize=True)))
    assert doc["model"] == stub.Info(pb.InfoRequest()).model and doc["encoding"] == "float32"
    np.testing.assert_allclose(np.array(doc["embeddings"]), want, atol=2e-6)


def test_npy_file_with_options_and_stdin(server, stub, tmp_path):
    out = tmp_path / "v.npy"
    done = pollen_embed("-", "--server", server.listen, "--format", "npy", "-o", str(out), "--dimensions", "32",
                        "--encoding", "float16", stdin="first line\nsecond line\n")
    assert done.returncode == 0, done.stderr
    got = np.load(out)
    want = vectors(stub.Embed(pb.EmbedRequest(texts=["first line", "second line"], dimensions=32, normalize=True)))
    assert got.dtype == np.float16 and got.shape == (2, 32)
    np.testing.assert_allclose(got, want.astype(np.float16), atol=2e-3)


def test_errors_exit_nonzero_with_the_reason(server):
    bad_flag = pollen_embed("x", "--encoding", "int4", "--server", server.listen)
    assert bad_flag.returncode == 2 and "invalid choice: 'int4'" in bad_flag.stderr
    refused = pollen_embed("", "--server", server.listen)
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr and "empty" in refused.stderr
    assert refused.stdout == ""
