"""`pollen embed` as a user runs it, against the real server."""
from __future__ import annotations

import json
import subprocess

import numpy as np

from pollen.v1 import embedder_pb2 as pb
from tests.conftest import POLLEN, free_port, vectors


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


def test_no_server_at_the_address_is_said_at_once():
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = pollen_embed("x", "--server", nobody)  # the default --timeout is 300 s
    assert done.returncode == 1 and f"UNAVAILABLE: no answer from {nobody}" in done.stderr
    assert "the server answered" not in done.stderr


def test_bad_output_settings_are_refused_before_any_work(tmp_path):
    nobody = f"127.0.0.1:{free_port()}"  # never reached: each is refused first
    missing = pollen_embed("x", "--server", nobody, "-o", str(tmp_path / "no" / "such" / "v.json"))
    assert missing.returncode == 2 and "cannot write" in missing.stderr and "Traceback" not in missing.stderr
    scales = pollen_embed("x", "--server", nobody, "--encoding", "int8", "--format", "npy")
    assert scales.returncode == 2 and "scales go to FILE.scales.npy" in scales.stderr
    negative = pollen_embed("x", "--server", nobody, "--max-tokens", "-5")
    assert negative.returncode == 2 and "argument --max-tokens" in negative.stderr


def test_token_vectors(server, stub):
    done = pollen_embed("hello there", "bees", "--tokens", "--no-normalize", "--server", server.listen)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    reply = stub.Embed(pb.EmbedRequest(texts=["hello there", "bees"], outputs=[pb.OUTPUT_TOKENS]))
    want = np.split(np.frombuffer(reply.token_embeddings, np.float32).reshape(-1, reply.dims),
                    np.cumsum(reply.token_counts)[:-1])
    assert [len(rows) for rows in doc["token_embeddings"]] == [len(w) for w in want]
    for rows, w in zip(doc["token_embeddings"], want):
        np.testing.assert_allclose(np.array(rows), w, atol=2e-6)
    npy = pollen_embed("x", "--tokens", "--format", "npy", "-o", "/dev/null", "--server", server.listen)
    assert npy.returncode == 2 and "--format json" in npy.stderr
    stray = pollen_embed("x", "--sparse-top-k", "3", "--server", server.listen)
    assert stray.returncode == 2 and "--sparse-top-k goes with --sparse" in stray.stderr
    refused = pollen_embed("x", "--sparse", "--server", server.listen)  # a dense model
    assert refused.returncode == 1 and "sparse head" in refused.stderr
