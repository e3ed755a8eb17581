"""No import cycle among the product's modules: each module's imports, read with `ast` (those inside
functions too), make a graph over the pollen.* modules of the product folders, which must have no
cycle. A cycle is named module by module, so it can be cut where it is found."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where each product package lives in the checkout (pyproject.toml's package-dir).
PACKAGES = {"pollen": "protos/pollen", "pollen.common": "common", "pollen.server": "server",
            "pollen.shared_mem": "shared_mem", "pollen.worker": "worker", "pollen.client": "client",
            "pollen.bulk": "bulk"}


def product_modules() -> dict[str, pathlib.Path]:
    """Every product module's dotted name and file (a package by its __init__.py)."""
    modules = {}
    for package, folder in PACKAGES.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if package == "pollen" and parts[0] != "v1" and parts != ["__init__"]:
                continue  # protos/pollen holds pollen/__init__.py and pollen/v1: the rest is another package's
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The product modules `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from package import name`: the submodule `name` where there is one, else the package.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle a depth-first walk meets, as its modules from where it starts back to there."""
    found, done, path = [], set(), []

    def visit(node: str) -> None:
        path.append(node)
        for child in sorted(graph[node]):
            if child in path:
                found.append(path[path.index(child):] + [child])
            elif child not in done:
                visit(child)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    return found


def test_the_graph_sees_the_product_and_its_imports():
    graph = import_graph()
    assert {"pollen.v1.embedder_pb2", "pollen.worker.loop", "pollen.worker.models.qwen3", "pollen.server.cli"} <= set(graph)
    assert "pollen.worker.batcher" in graph["pollen.worker.loop"]
    assert "pollen.worker.cuda_engine" in graph["pollen.worker.engine"]  # an import inside a function


def test_cycles_are_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_no_import_cycle_among_product_modules():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in found)


# server/'s layers (each subpackage's docstring says the same): what each part of the frontend may
# import of the others. The doors translate and nothing else, so they reach the pipeline and the
# tasks only through the core, and never each other.
SERVER_LAYERS = {
    "observe": set(),
    "config": {"observe"},
    "auth": set(),
    "tei": set(),
    "pipeline": {"observe", "config"},
    "tasks": {"pipeline", "observe", "config"},
    "model_table": {"pipeline", "tasks", "observe", "config"},
    "core": {"pipeline", "tasks", "model_table", "observe", "config", "auth"},
    "grpc_api": {"core", "model_table", "observe", "config", "auth", "tei"},
    "http_api": {"core", "model_table", "observe", "config", "auth", "tei"},
    "process": {"pipeline", "tasks", "model_table", "core", "grpc_api", "http_api", "observe", "config", "auth",
                "tei"},
    "cli": {"process", "config"},
}


def server_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["pollen", "server"] and len(parts) > 2 else None


def test_each_part_of_server_imports_only_the_layers_below_it():
    graph = import_graph()
    parts = {server_part(m) for m in graph} - {None}
    assert parts == set(SERVER_LAYERS), "a part of server/ has no layer here (or a layer no part)"
    wrong = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                   if (part := server_part(module)) and (theirs := server_part(target)) and theirs != part
                   and theirs not in SERVER_LAYERS[part])
    assert wrong == []


def test_the_layer_check_catches_a_door_that_reaches_past_the_core():
    assert server_part("pollen.server.http_api.door") == "http_api"
    assert "pipeline" not in SERVER_LAYERS["http_api"] and "grpc_api" not in SERVER_LAYERS["http_api"]
