"""Generate the Python code for the .proto files under protos/pollen next to them.

pollen's own API (pollen/v1) compiles with protos/ as its root, so its files are named
pollen/v1/... in the descriptor pool. TEI's API (pollen/tei/v1/tei.proto) compiles with its own
folder as the root, so that it is named `tei.proto` as in TEI and in its clients' stubs: a
descriptor pool accepts the same file twice, never two files that define the same names. It
gets no gRPC stubs (the server registers its methods from the descriptor: server/grpc_api/tei.py).

The generated modules are committed; tests/test_protos_fresh.py regenerates them into a
temporary folder and fails when the committed ones are stale. Run after editing a .proto:

    python protos/generate.py
"""
from __future__ import annotations

import pathlib
import sys

PROTOS = pathlib.Path(__file__).resolve().parent
TEI = "pollen/tei/v1"  # TEI's tei.proto and its generated module, pollen.tei.v1.tei_pb2


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (from grpcio-tools) over every .proto; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    sources = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.glob("pollen/**/*.proto")
                     if not p.is_relative_to(PROTOS / TEI))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    run = [["protoc", f"-I{PROTOS}", f"-I{well_known}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *sources]]
    (out_dir / TEI).mkdir(parents=True, exist_ok=True)
    run.append(["protoc", f"-I{PROTOS / TEI}", f"--python_out={out_dir / TEI}", f"--pyi_out={out_dir / TEI}",
                "tei.proto"])
    for args in run:
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out_dir.glob("pollen/**/*") if p.suffix in (".py", ".pyi") and p.name != "__init__.py")


if __name__ == "__main__":
    for path in generate(PROTOS):
        print(path.relative_to(PROTOS))
    sys.exit(0)
