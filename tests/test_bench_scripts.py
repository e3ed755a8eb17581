"""load/'s result files, A/B table and GPU run scripts, on this machine (no GPU): the result
convention's names and round trip, the A/B verdicts, tables of partial runs, every flag
load/run_gpu.sh and load/ab_commits.sh pass being one the benchmark takes, load/bench_models.py's
and load/bench_sparse.py's smoke runs on the CPU (tiny models, real servers), and load/bench_cpu.py's
(pollen and its engine alone against sentence-transformers and ONNX Runtime, quiet and busy)."""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load import ab_report, arch_models, results_file  # noqa: E402


def test_load_holds_at_most_twelve_benchmark_scripts_each_described_in_performance_md():
    """A knob study is a flag of its benchmark, not a script of its own: load/ keeps at most 12
    benchmarks, and docs/performance.md says what each measures."""
    scripts = sorted(p.name for p in (REPO / "load").glob("bench_*.py"))
    assert len(scripts) <= 12, scripts
    named = (REPO / "docs" / "performance.md").read_text()
    assert [s for s in scripts if s not in named] == []


@pytest.mark.parametrize("name, kind", [("NVIDIA H200", "gpu-h200"), ("NVIDIA H100 80GB HBM3", "gpu-h100-80gb-hbm3"),
                                        ("NVIDIA GeForce RTX 4090", "gpu-geforce-rtx-4090"), ("", "gpu-unknown")])
def test_a_gpu_kind_is_a_slug_of_its_name(name, kind):
    assert results_file.gpu_kind(name) == kind
    assert results_file.NAME.match(f"engine-{kind}.md")


def test_a_cpu_run_is_of_kind_cpu():
    assert results_file.device_kind("cpu") == "cpu"
    assert results_file.result_path("http", "cpu") == REPO / "load" / "results" / "http-cpu.md"


def test_a_result_file_holds_title_command_commit_text_and_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(REPO / "load" / "bench_engine.py"), "--shapes", "qwen3-0.6b", "--x", "a b"])
    path = results_file.write_result("engine", "gpu-h200", "Title", "| a |\n| --- |\n| 1 |\n",
                                     {"docs": {"tokens_per_s": 4.5e5}, "n": [1, 2]}, str(tmp_path / "r.md"))
    text = path.read_text()
    assert text.startswith("# Title\n\nCommand: `python load/bench_engine.py --shapes qwen3-0.6b --x 'a b'`\n\nCommit: ")
    assert "| a |\n| --- |\n| 1 |\n" in text
    assert results_file.read_figures(path) == {"docs": {"tokens_per_s": 4.5e5}, "n": [1, 2]}
    assert "wrote" in capsys.readouterr().out
    again = results_file.write_result("engine", "gpu-h200", "Again", "t", {"n": 3}, str(path), command="bash x.sh",
                                      commit="old a, new b")
    assert again.read_text().startswith("# Again\n\nCommand: `bash x.sh`\n\nCommit: old a, new b\n")  # replaced


def test_the_measured_commit_is_that_of_the_imported_pollen():
    commit = results_file.measured_commit()
    assert commit == "unknown" or re.match(r"^[0-9a-f]{7,}", commit)


def write_figures(folder: pathlib.Path, name: str, side: str, round_: int, figures: dict) -> None:
    results_file.write_result(name, "cpu", name, "", figures, str(folder / f"{name}-{side}-{round_}.md"))


def figures_of(name: str, value: float) -> dict:
    return {"engine": {"shapes": [{"ours_graphs": {"docs": {"tokens_per_s": value}}}]},
            "e2e": {"docs": {"tokens_per_s": value}},
            "unary": {"levels": {"unary-128": {"queries_per_s": value, "p99_ms": 9.0,
                                               "cores_busy": {"frontends": 4.0, "workers": 1.0}}}},
            "one": {"rows": [{"client": "sync", "p50_ms": value}]}}[name]


def test_the_ab_table_compares_medians_within_three_percent(tmp_path):
    rounds = {"engine": ([450e3, 452e3], [446e3, 440e3]),  # 0.98: kept
              "e2e": ([440e3, 444e3], [420e3, 425e3]),     # 0.96: lost
              "unary": ([20e3, 21e3], [21e3, 22e3]),       # faster
              "one": ([1.60, 1.62], [1.70, 1.69])}         # 1.06 slower: lost
    for name, (old, new) in rounds.items():
        for r, (o, n) in enumerate(zip(old, new), 1):
            write_figures(tmp_path, name, "old", r, figures_of(name, o))
            write_figures(tmp_path, name, "new", r, figures_of(name, n))
    values = ab_report.collect(tmp_path)
    assert values["engine"] == {"old": [450e3, 452e3], "new": [446e3, 440e3]}
    text = ab_report.table(values, "aaa", "bbb")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["engine docs (bench_engine --docs-only)"].endswith("| 451,000 | 443,000 | 0.982 | yes |")
    assert rows["docs through EmbedStream (bench_e2e --docs-only)"].endswith("| NO |")
    assert rows["unary queries at 128 clients (bench_concurrency)"].endswith("| yes |")
    # 5 cores busy at 20,500 and 21,500 q/s: the whole server's CPU a query falls, as it should
    assert rows["the server's CPU a query at 128 clients"].endswith("| 244 | 233 | 0.953 | yes |")
    assert "unary queries at 512 clients" not in text  # not asked for: no row
    assert rows["one client p50, blocking stub (bench_one_client)"].endswith("| 1.610 | 1.695 | 1.053 | NO |")


def test_an_ab_figure_missing_on_one_side_is_not_measured(tmp_path):
    write_figures(tmp_path, "unary", "old", 1, figures_of("unary", 20e3))
    write_figures(tmp_path, "unary", "new", 1, {"levels": {}})  # that run answered nothing
    text = ab_report.table(ab_report.collect(tmp_path), "a", "b")
    assert "| unary queries at 128 clients (bench_concurrency) | queries/s | 20,000 | - | | | | not measured |" in text


def test_tables_of_partial_runs():
    from load import bench_e2e, bench_engine

    meta = {"gpu": "NVIDIA H200", "driver": "1", "torch": "2", "cuda": "13", "transformers": "5", "python": "3.12",
            "date": "d"}
    shapes = [{"shape": "qwen3-0.6b", "ours_graphs": {"docs": {"tokens_per_s": 450e3, "mfu": 0.5}}}]
    assert "| qwen3-0.6b | docs tokens/s (MFU) | - | - | 450,000 (50%) |  |" in bench_engine.markdown(meta, 8e14, shapes)
    res = {"meta": meta, "docs": {"tokens_per_s": 440e3}}
    assert "| qwen3-0.6b | - | 440,000 | - | - |" in bench_e2e.markdown(res, argparse.Namespace(shape="qwen3-0.6b"))


def invocations(script: pathlib.Path) -> dict[str, set[str]]:
    """load/bench_<name>.py -> the flags a shell script passes it (continued lines joined)."""
    text = script.read_text().replace("\\\n", " ")
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for match in re.finditer(r"(load/bench_\w+\.py)([^;|&]*)", line):
            out.setdefault(match[1], set()).update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", match[2]))
    return out


@pytest.mark.parametrize("script", ["run_gpu.sh", "ab_commits.sh"])
def test_the_gpu_scripts_pass_only_flags_the_benchmarks_take(script):
    path = REPO / "load" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    calls = invocations(path)
    assert calls
    for bench, flags in calls.items():
        helped = subprocess.run([sys.executable, str(REPO / bench), "--help"], capture_output=True, text=True,
                                timeout=300)
        assert helped.returncode == 0, helped.stderr
        unknown = {f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}\b", helped.stdout)}
        assert not unknown, f"{script} passes {bench} {sorted(unknown)}"


def smoke_run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """load/<script> with `args` in a child process, offline, its output captured."""
    return subprocess.run([sys.executable, str(REPO / "load" / script), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})


@pytest.mark.slow
def test_bench_models_smoke_run_serves_every_shape_and_writes_its_table(tmp_path):
    """load/bench_models.py --device cpu: tiny versions of every shape built, served by `pollen serve`
    and encoded by sentence-transformers, which counts the same tokens as the server; one row each."""
    out = tmp_path / "models-cpu.md"
    run = smoke_run("bench_models.py", "--device", "cpu", "--root", str(tmp_path / "ckpt"), "--out", str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    rows = {r["shape"]: r for r in results_file.read_figures(out)["rows"]}
    assert list(rows) == list(arch_models.MODELS_SHAPES)
    table = out.read_text()
    for name, row in rows.items():
        assert row["pollen"]["texts"] > 0 and row["pollen"]["errors"] == 0
        assert row["pollen"]["tokens"] >= row["pollen"]["texts"] * 8  # texts of 8 to 48 tokens
        assert row["reference"]["tokens"] == row["tokens"]  # sentence-transformers' tokenizer agrees
        assert all(row["reference"][f"bs{bs}"]["tokens_per_s"] > 0 for bs in (32, 128))
        assert re.search(rf"^\| {re.escape(name)} \| .+ \| [\d.,]+x \|$", table, re.M), name


@pytest.mark.slow
def test_bench_sparse_smoke_run_serves_splade_and_bge_m3_and_writes_its_table(tmp_path):
    """load/bench_sparse.py --device cpu: a tiny SPLADE folder and a tiny bge-m3 folder built and
    served by `pollen serve` (SPLADE answering sparse rows, bge-m3 all three outputs, then dense
    only and its weights served as a plain embedder, both up, in turn), the references encoding the same texts;
    one row each, every figure measured."""
    out = tmp_path / "sparse-cpu.md"
    run = smoke_run("bench_sparse.py", "--device", "cpu", "--root", str(tmp_path / "ckpt"), "--out", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = {r["row"]: r for r in results_file.read_figures(out)["rows"]}
    assert list(rows) == ["splade-bert-base", "bge-m3 all outputs", "bge-m3 dense only"]
    for name, row in rows.items():
        assert not row.get("refused"), row["refused"]
        assert row["pollen"]["texts"] > 0 and row["pollen"]["errors"] == 0, name
        assert row["pollen"]["tokens"] >= row["pollen"]["texts"] * 8  # texts of 8 to 48 tokens
    for name in ("splade-bert-base", "bge-m3 all outputs"):
        ref = rows[name]["reference"]
        assert ref["tokens"] == rows[name]["tokens"]  # the reference's tokenizer counts the server's tokens
        assert all(v["tokens_per_s"] > 0 for k, v in ref.items() if k.startswith("bs")), name
    assert 0 < rows["splade-bert-base"]["reference"]["bs32"]["terms_per_text"] < 1000  # sparse rows
    dense = rows["bge-m3 dense only"]
    assert dense["plain"]["texts"] > 0 and dense["plain"]["errors"] == 0
    # the two servers a few percent apart took the load in turn, two rounds each
    assert len(dense["plain"]["rounds_tokens_per_s"]) == len(dense["pollen"]["rounds_tokens_per_s"]) == 2
    table = out.read_text()
    for name in rows:
        assert re.search(rf"^\| {re.escape(name)} \| .+ \| [\d.,]+x \|$", table, re.M), name


def test_bench_fp8_smoke_run_measures_fidelity_of_every_shape_and_minilm(tmp_path):
    """load/bench_fp8.py --device cpu: tiny Qwen3 shapes and all-MiniLM-L6-v2's real weights, each in
    bfloat16 and with fp8 products through torch's references; cosines and STS-B Spearman measured."""
    out = tmp_path / "fp8-cpu.md"
    run = smoke_run("bench_fp8.py", "--device", "cpu", "--root", str(tmp_path / "ckpt"), "--out", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    figures = results_file.read_figures(out)
    assert [r["shape"] for r in figures["shapes"]] == ["qwen3-0.6b", "qwen3-4b", "qwen3-8b"]
    for row in figures["shapes"]:
        assert row["texts"] == 40 and 0.9 < row["cosine"]["min"] <= row["cosine"]["mean"] < 1.0, row
    minilm = figures["minilm"]
    assert minilm["pairs"] == 40 and 0.9 < minilm["cosine"]["min"] < 1.0
    assert abs(minilm["stsb_fp8"] - minilm["stsb_bf16"]) < 5  # x100; the full test set's figure is docs/performance.md's
    assert re.search(r"^\| qwen3-8b \| 40 \(\d+\) \| 0\.\d{5} / ", out.read_text(), re.M)


@pytest.mark.slow
def test_bench_cpu_smoke_run_measures_each_contender_quiet_and_busy(tmp_path):
    """load/bench_cpu.py --smoke: pollen (on ONNX Runtime, and on its torch engine), its engine without the
    server, sentence-transformers and ONNX Runtime (the checkpoint exported to ONNX) on the same texts, quiet
    and under one busy process; every figure measured, every vector within 0.9999 cosine of
    sentence-transformers', memory per process, and the issue's ratios."""
    out = tmp_path / "cpu.md"
    run = smoke_run("bench_cpu.py", "--smoke", "--out", str(out), "--onnx-dir", str(tmp_path / "onnx"), timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    figures = results_file.read_figures(out)
    rows = {(r["contender"], r["condition"]): r for r in figures["rows"]}
    for key in ("pollen", "pollen-torch", "engine", "st", "ort"):
        for condition in ("quiet", "busy"):
            row = rows[(key, condition)]
            for metric in ("query_p50_ms", "query_p99_ms", "cpu_ms_per_query", "docs_texts_per_s", "docs_tokens_per_s",
                           "docs_cpu_s", "pss_mib"):
                assert row[metric]["median"] > 0, (key, condition, metric)
            assert row["min_cosine"] >= 0.9999, (key, condition)
            assert all(m["pss_mib"] > 0 for m in row["memory_per_process"].values()), (key, condition)
    assert len(rows[("pollen", "quiet")]["memory_per_process"]) >= 3  # supervisor, frontend, worker
    assert "fastembed" in figures["contenders"] or figures["skipped"]["fastembed"]
    assert all(r["min_cosine"] >= 0.9999 for r in figures["runs"])
    assert {"pollen / ORT query p50, quiet", "pollen / ORT docs texts/s, quiet", "pollen / ORT CPU seconds per query, quiet",
            "pollen docs texts/s, busy / quiet", "pollen / sentence-transformers docs texts/s, busy",
            "pollen query p50, busy / quiet", "pollen / pollen engine query p50, quiet",
            "pollen / pollen (torch engine) docs texts/s, quiet"} <= set(figures["ratios"])
    engines = {r["contender"]: r["info"].get("engine") for r in figures["runs"]}
    assert engines["engine"] == "OnnxEngine"  # the engine the server runs by default
    assert figures["runs"] and all(r["info"]["environment"]["GOMP_SPINCOUNT"] is not None
                                   for r in figures["runs"] if r["contender"] == "engine")  # the worker's
    assert figures["onnx_export"]["reused"] is False  # a fresh folder: exported by this run
    text = out.read_text()
    assert "| pollen | busy |" in text and "| ONNX Runtime | quiet |" in text and "while True: pass" in text
    assert "| pollen (torch engine) | quiet |" in text


@pytest.mark.slow
def test_bench_rerank_tokenize_smoke_run_times_both_libraries_and_writes_its_table(tmp_path):
    """load/bench_rerank.py --tokenize on this machine's cores: a row for the tokenizers library and for tokie
    at each fan-out, for both tokenizers; tokie's calls tokenize more characters a second."""
    from tests.st_models import copy_bert_tokenizer

    qwen3 = os.environ.get("POLLEN_QWEN3_TOKENIZER")
    bert = tmp_path / "bert"
    bert.mkdir()
    copy_bert_tokenizer(bert)
    if not qwen3:  # any tokenizer.json stands in: the script reads the file's own kind
        qwen3 = str(bert / "tokenizer.json")
    out = tmp_path / "tokenize-cpu.md"
    run = smoke_run("bench_rerank.py", "--tokenize", "--bert-tokenizer", str(bert), "--qwen3-tokenizer", qwen3,
                    "--fan-outs", "1,0", "--callers", "1,2", "--seconds", "0.3", "--out", str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    rows = results_file.read_figures(out)["rows"]
    assert len(rows) == 2 * (2 + 2 * 2)  # two tokenizers: the library at two caller counts, tokie at 2 x 2
    for name in {r["tokenizer"] for r in rows}:
        ours = [r for r in rows if r["tokenizer"] == name]
        hf = max(r["mchars_per_s"] for r in ours if r["library"] == "tokenizers")
        assert min(r["mchars_per_s"] for r in ours if r["library"] == "tokie") > hf
        assert all(r["calls"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in ours)
    assert "| tokie |" in out.read_text()


@pytest.mark.slow
def test_bench_rerank_cpu_smoke_run_times_pollen_and_cross_encoder(tmp_path):
    """load/bench_rerank.py --device cpu: pollen on its defaults and a variant's flags, and
    CrossEncoder at each batch size, each one call of 100 documents, in the table and figures."""
    out = tmp_path / "rerank-cpu.md"
    run = smoke_run("bench_rerank.py", "--device", "cpu", "--root", str(tmp_path / "ckpt"), "--rounds", "1",
                    "--calls", "1", "--cpu-batch-sizes", "32", "--variant=--max-batch-tokens 4096", "--out", str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    rows = results_file.read_figures(out)["rows"]
    assert [(r["contender"], r["flags"]) for r in rows] == [("pollen", ""), ("pollen", "--max-batch-tokens 4096"),
                                                             ("CrossEncoder", "batch_size=32")]
    assert all(r["calls"] == 1 and r["p99_ms"] >= r["p50_ms"] > 0 and r["pairs_per_s"] > 0 for r in rows)
    assert "| pollen | --max-batch-tokens 4096 |" in out.read_text()
