"""Generate the Python code for protos/pollen/v1/*.proto next to the .proto files.

The generated modules are committed; tests/test_protos_fresh.py regenerates them into a
temporary folder and fails when the committed ones are stale. Run after editing a .proto:

    python protos/generate.py
"""
from __future__ import annotations

import pathlib
import sys

PROTOS = pathlib.Path(__file__).resolve().parent


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (from grpcio-tools) over every .proto; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    sources = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.glob("pollen/**/*.proto"))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out_dir.glob("pollen/**/*") if p.suffix in (".py", ".pyi") and p.name != "__init__.py")


if __name__ == "__main__":
    for path in generate(PROTOS):
        print(path.relative_to(PROTOS))
    sys.exit(0)
