"""The rough edges a new user hit (issue 32, item 6), each fixed and held: the default model's
names resolve to its bundled copy offline; HTTP `dimensions: 0` is the full size, as the refusal
of a bad size says; `pollen embed` errors name its flags, not proto enums; a failed start ends
with its error, not with "stopped"."""
from __future__ import annotations

import json
import socket
import subprocess
import urllib.request

import pytest

from pollen.client.command import cli_wording
from pollen.common import model_source
from pollen.common.model_spec import DEFAULT_MODEL_NAME, default_model_path
from tests.conftest import POLLEN, ServerProcess

LONG = " ".join(f"word{i}" for i in range(400))


@pytest.mark.parametrize("name", ["all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"])
def test_default_model_names_resolve_to_the_bundled_copy(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_source.resolve(name) == (default_model_path(), DEFAULT_MODEL_NAME)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--model", "all-MiniLM-L6-v2").start()  # the README's name, offline
    yield srv
    assert srv.terminate() == 0


def post(server, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{server.http_listen}/v1/embeddings", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_dimensions_zero_is_the_full_size(server):
    code, answer = post(server, {"input": "a bee", "dimensions": 0})
    assert code == 200 and len(answer["data"][0]["embedding"]) == 384
    assert answer["model"] == DEFAULT_MODEL_NAME
    code, refusal = post(server, {"input": "a bee", "dimensions": 9999})
    assert code == 400 and "0 (full size)" in refusal["error"]["message"]


def test_embed_cli_names_its_flags(server):
    done = subprocess.run([POLLEN, "embed", "--server", server.listen, "--truncate", "none", LONG],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "--truncate end or --truncate start" in done.stderr and "--long-input chunk_mean" in done.stderr
    assert "TRUNCATE_" not in done.stderr and "LONG_INPUT_" not in done.stderr
    assert cli_wording("truncate TRUNCATE_START does not apply to Rerank") == "--truncate start does not apply to Rerank"


def test_failed_start_ends_with_its_error(tmp_path):
    with socket.socket() as taken:  # the gRPC port, held by something that is not pollen
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        log = tmp_path / "serve.log"
        srv = ServerProcess(listen=f"127.0.0.1:{taken.getsockname()[1]}", log=str(log))
        with pytest.raises(RuntimeError, match="exited"):
            srv.start(timeout=120)
        srv.proc.wait(30)
    lines = [line for line in log.read_text().splitlines() if " pollen" in line]
    errors = [i for i, line in enumerate(lines) if " ERROR " in line]
    assert errors, lines
    assert not any(line.rstrip().endswith("pollen: stopped") for line in lines), lines
