"""Every manifest under deploy/kubernetes, checked offline against the Kubernetes API schemas that
kubernetes-validate ships (strict: an unknown or misspelt field fails too), for the oldest version
with native sidecars on by default and the newest one it knows; plus what the API server checks
that the schemas leave out (every container names an image), and that each /dev/shm volume holds
what its pollen container's settings need."""
from __future__ import annotations

import copy
import os
import pathlib
import socket
import stat
import urllib.request

import kubernetes_validate
import pytest
import yaml

from pollen.client import Client
from pollen.server.config import ServeConfig
from pollen.server.process.app import shm_need, worker_rings_need
from tests.conftest import ServerProcess, free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
# Native sidecars (init containers with restartPolicy Always) are on by default from 1.29.
VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())


@pytest.fixture
def offline(monkeypatch):
    """Validation must need no network: any connection or name lookup fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network use during validation: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def documents(path: pathlib.Path) -> list[dict]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def pod_spec(doc: dict) -> dict | None:
    return doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else None


def problems(doc: dict, version: str) -> list[str]:
    """Why the API server would refuse `doc`: the schema's first error (a missing schema is one
    too), then the containers without an image (optional in the schema, required by the server)."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    spec = pod_spec(doc) or {}
    containers = spec.get("initContainers", []) + spec.get("containers", [])
    return [f"container {c['name']} has no image" for c in containers if not c.get("image")]


def test_there_are_the_sidecar_the_gpu_sidecar_and_the_pool():
    kinds = sorted((path.name, doc["kind"]) for path in MANIFESTS for doc in documents(path))
    assert kinds == [("pool.yaml", "Deployment"), ("pool.yaml", "Service"),
                     ("sidecar-cpu.yaml", "Deployment"), ("sidecar-gpu.yaml", "Deployment")]


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_validates_against_the_schemas(path, version):
    for doc in documents(path):
        assert problems(doc, version) == [], f"{path.name}: {doc['kind']}/{doc['metadata']['name']}"


def sidecar(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["initContainers"][0]


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("version", VERSIONS)
def test_broken_copies_fail_validation(version):
    (good,) = documents(ROOT / "deploy" / "kubernetes" / "sidecar-cpu.yaml")
    wrong_type = copy.deepcopy(good)
    sidecar(wrong_type)["ports"][0]["containerPort"] = "eighty"
    assert problems(wrong_type, version) == [
        "spec.template.spec.initContainers.0.ports.0.containerPort: 'eighty' is not of type 'integer'"]
    misspelt = copy.deepcopy(good)
    sidecar(misspelt)["readinesProbe"] = sidecar(misspelt).pop("readinessProbe")
    assert "'readinesProbe' was unexpected" in problems(misspelt, version)[0]
    no_image = copy.deepcopy(good)
    del sidecar(no_image)["image"]
    kubernetes_validate.validate(no_image, version, strict=True)  # the schema allows it...
    assert problems(no_image, version) == ["container pollen has no image"]  # ...the server does not


def test_the_sidecar_starts_before_the_search_service_and_is_probed():
    for name in ("sidecar-cpu.yaml", "sidecar-gpu.yaml"):
        (doc,) = documents(ROOT / "deploy" / "kubernetes" / name)
        pollen = sidecar(doc)
        assert pollen["name"] == "pollen" and pollen["restartPolicy"] == "Always"
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(pollen)
    (gpu,) = documents(ROOT / "deploy" / "kubernetes" / "sidecar-gpu.yaml")
    assert sidecar(gpu)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sidecar(gpu)["livenessProbe"]["grpc"] == {"port": 50051}


def quantity(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_each_dev_shm_volume_holds_its_pollen_and_one_worker_restart(path):
    """The memory emptyDir on /dev/shm is at least what pollen checks at start (server/process/app.py,
    shm_need) from the container's POLLEN_* settings, plus a second set of one worker's rings (a
    restarted worker's new rings exist while the old ones are still mapped)."""
    for doc in documents(path):
        spec = pod_spec(doc)
        if spec is None:
            continue
        pollen = next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "pollen")
        cfg = ServeConfig.from_args([], environ={e["name"]: e["value"] for e in pollen["env"]})
        restart = worker_rings_need(cfg)
        mount = next(m for m in pollen["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["emptyDir"]["medium"] == "Memory"
        assert quantity(volume["emptyDir"]["sizeLimit"]) >= shm_need(cfg) + restart


def test_the_cpu_sidecars_settings_serve_the_search_service_on_the_unix_socket(tmp_path):
    """pollen started with the CPU sidecar's POLLEN_* variables (the socket in a temporary folder,
    HTTP on loopback): /health answers the probes, a client embeds over the socket, whose mode
    lets the pod's group in, and SIGTERM stops it cleanly."""
    (doc,) = documents(ROOT / "deploy" / "kubernetes" / "sidecar-cpu.yaml")
    env = {e["name"]: e["value"] for e in sidecar(doc)["env"]}
    assert env["POLLEN_LISTEN"] == "unix:/run/pollen/pollen.sock"
    socket_path = tmp_path / "pollen.sock"
    env.update(POLLEN_LISTEN=f"unix:{socket_path}", POLLEN_HTTP_LISTEN=f"127.0.0.1:{free_port()}")
    srv = ServerProcess(env=env, listen=f"unix:{socket_path}", http_listen=env["POLLEN_HTTP_LISTEN"])
    srv.args = ["serve"]  # the variables alone, as in the pod
    srv.start()
    try:
        probe = sidecar(doc)["readinessProbe"]["httpGet"]["path"]
        with urllib.request.urlopen(f"http://{env['POLLEN_HTTP_LISTEN']}{probe}", timeout=5) as reply:
            assert reply.status == 200
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o660
        with Client(f"unix://{socket_path}") as client:
            assert client.embed(["a query from the search service"]).shape == (1, 384)
    finally:
        assert srv.terminate() == 0
