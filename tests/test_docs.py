"""The docs a newcomer reads: every file they name exists, their sizes stay readable, and every
flag of `pollen serve` is said in docs/configuration.md."""
from __future__ import annotations

import dataclasses
import pathlib
import re

from pollen.common.engine_options import EngineOptions
from pollen.server.config import ServeConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FOLDERS = ("common", "server", "shared_mem", "worker", "client", "bulk", "load", "tests", "protos", "docs", "deploy")
# A path in the repository: one of its folders, then names, ending in a file (the results files
# named bare, `engine-gpu-h200.md`, are load/results/'s).
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(FOLDERS) + r")/[\w./-]*[\w])")


def named_paths(text: str) -> set[str]:
    return {m.rstrip(".") for m in PATH.findall(text) if "<" not in m and "*" not in m}


def test_every_file_the_docs_name_exists():
    missing = sorted(f"{doc.relative_to(REPO)}: {path}" for doc in DOCS for path in named_paths(doc.read_text())
                     if not (REPO / path).exists())
    assert missing == []


def test_the_path_check_sees_a_path():
    assert named_paths("see `server/core.py` and server/pipeline/, not xserver/a.py") == {"server/core.py",
                                                                                       "server/pipeline"}


def test_the_readme_and_the_overview_stay_short():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 450
    table = readme.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert 1 < len(rows) <= 9  # the header and at most 8 figures
    assert len((REPO / "docs" / "architecture.md").read_text().splitlines()) <= 300


def test_every_flag_is_said_in_the_configuration_page():
    page = (REPO / "docs" / "configuration.md").read_text()
    flags = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(ServeConfig) if f.init]
    flags += ["--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineOptions)]
    assert [f for f in flags if f"`{f}" not in page] == []


def test_the_configuration_page_lists_the_tuning_knobs_help_leaves_out():
    from pollen.server.config import TUNING

    page = (REPO / "docs" / "configuration.md").read_text()
    listed = page.split("The tuning knobs:", 1)[1].split("\n\n", 1)[0]
    tuning = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ServeConfig) if f.metadata.get("group") == TUNING}
    assert set(re.findall(r"`(--[a-z0-9-]+)`", listed)) == tuning


def test_serve_help_lists_at_most_35_flags_and_help_all_every_one(capsys):
    import pytest

    for argv, most in ((["--help"], 35), (["--help-all"], 200)):
        with pytest.raises(SystemExit):
            ServeConfig.from_args(argv, environ={})
        shown = re.findall(r"^  (--[a-z0-9-]+)", capsys.readouterr().out, re.M)
        assert len(shown) <= most
    flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ServeConfig) if f.init}
    assert flags <= set(shown)
