"""--model as a Hugging Face Hub id, served from the Hugging Face cache with no network: a cache
laid out as huggingface_hub lays it (models--org--name/{blobs,snapshots/<commit>,refs/main})
holding all-MiniLM-L6-v2's files, HF_HUB_CACHE pointing at it, and HF_ENDPOINT at a closed port so
that nothing could be fetched even if something tried."""
from __future__ import annotations

import json
import os
import subprocess

import grpc
import numpy as np
import pytest

from pollen.common.model_spec import default_model_path
from pollen.v1 import embedder_pb2 as pb
from pollen.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import POLLEN, ServerProcess, free_port, vectors

REPO_ID = "pollen-test/mini-lm"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root, repo_id: str = REPO_ID, commit: str = COMMIT, ref: str = "main") -> str:
    """A Hugging Face cache under `root` holding all-MiniLM-L6-v2 as `repo_id` at `commit`, `ref`
    naming it: snapshot files link to blobs, as huggingface_hub makes them (the blobs link to the
    packaged model's files instead of copying 90 MB). Returns the snapshot directory."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    src = default_model_path()
    for dirpath, _, files in os.walk(src):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), src)
            blob = repo / "blobs" / rel.replace("/", "_")
            if not blob.exists():
                blob.symlink_to(os.path.join(src, rel))
            target = snapshot / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.path.relpath(blob, target.parent))
    (repo / "refs" / ref).write_text(commit)
    return str(snapshot)


def offline_env(cache) -> dict:
    """No way to the network: offline mode, and the Hub's address a closed local port."""
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}


def pollen(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([POLLEN, *args], check=False, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "hub"
    snapshot = fake_hub_cache(root)
    return root, snapshot


def test_serve_a_hub_id_offline_from_the_cache(hub_cache, stub, tmp_path):
    cache, snapshot = hub_cache
    log = tmp_path / "serve.log"
    server = ServerProcess("--model", REPO_ID, env=offline_env(cache), log=str(log)).start()
    try:
        # Resolved once, by the supervisor, which then hands the snapshot directory to its children.
        assert log.read_text().count(f"model {REPO_ID} is {snapshot}") == 1
        texts = ["served from the cache", "東京 🙂"]
        with grpc.insecure_channel(server.listen) as channel:
            hub_stub = pb_grpc.EmbedderStub(channel)
            assert hub_stub.Info(pb.InfoRequest()).model == REPO_ID
            got = vectors(hub_stub.Embed(pb.EmbedRequest(texts=texts, normalize=True), timeout=60))
        # The same files as the packaged model's, so the same vectors as the default server's.
        want = vectors(stub.Embed(pb.EmbedRequest(texts=texts, normalize=True), timeout=60))
        np.testing.assert_allclose(got, want, atol=1e-6)
        import urllib.request

        with urllib.request.urlopen(f"http://{server.http_listen}/v1/models", timeout=10) as reply:
            assert json.load(reply)["data"][0]["id"] == REPO_ID
    finally:
        assert server.terminate() == 0


def test_a_missing_hub_model_offline_fails_at_start_in_one_line(hub_cache):
    cache, _ = hub_cache
    run = pollen("serve", "--model", "pollen-test/absent", "--listen", f"127.0.0.1:{free_port()}",
                 "--http-listen", "", env=offline_env(cache))
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, run.stderr
    assert "'pollen-test/absent' is not a local directory and not in the Hugging Face cache" in errors[0]
    assert str(cache) in errors[0] and "HF_HUB_OFFLINE" in errors[0] and "pollen download" in errors[0]
    assert "Traceback" not in run.stderr


def test_pollen_download_prints_the_cached_snapshot(hub_cache):
    cache, snapshot = hub_cache
    run = pollen("download", REPO_ID, env=offline_env(cache))
    assert (run.returncode, run.stdout) == (0, snapshot + "\n"), run.stderr
    # A commit names its snapshot without refs/; online mode with the Hub unreachable falls back to the cache.
    online = {**offline_env(cache), "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "2"}
    run = pollen("download", REPO_ID, "--revision", COMMIT, env=online)
    assert (run.returncode, run.stdout) == (0, snapshot + "\n"), run.stderr


def test_pollen_download_refuses_in_one_line(hub_cache, tmp_path):
    cache, _ = hub_cache
    run = pollen("download", "pollen-test/absent", "--revision", "v2", env=offline_env(cache))
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith("pollen download: model 'pollen-test/absent' (revision 'v2') is not a local")
    assert len(run.stderr.splitlines()) == 1, run.stderr
    # A model pollen cannot serve is refused now, not on the air-gapped host.
    unservable = tmp_path / "hub"
    snapshot = fake_hub_cache(unservable, "pollen-test/no-weights")
    os.unlink(os.path.join(snapshot, "model.safetensors"))
    run = pollen("download", "pollen-test/no-weights", env=offline_env(unservable))
    assert run.returncode == 1 and "no *.safetensors weights found" in run.stderr


def test_revision_needs_a_hub_id_and_paths_are_not_ids(hub_cache, tmp_path):
    cache, _ = hub_cache
    run = pollen("download", default_model_path(), "--revision", "main", env=offline_env(cache))
    assert run.returncode == 1 and "--revision 'main' applies to a Hub id" in run.stderr
    run = pollen("download", str(tmp_path / "nowhere"), env=offline_env(cache))
    assert run.returncode == 1 and "is not a directory (nor a Hugging Face Hub id" in run.stderr
    run = pollen("download", default_model_path(), env=offline_env(cache))
    assert (run.returncode, run.stdout) == (0, default_model_path() + "\n")


def test_model_source_tells_ids_from_paths():
    from pollen.common.model_source import looks_like_hub_id

    assert looks_like_hub_id("BAAI/bge-small-en-v1.5") and looks_like_hub_id("bert-base-uncased")
    for path in ("/models/bge", "./bge", "../bge", "~/bge", "a/b/c", "org/na me", "org--x/y", ""):
        assert not looks_like_hub_id(path), path
