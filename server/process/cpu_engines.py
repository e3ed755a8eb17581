"""Which engine runs each model on the CPU, settled in the supervisor before any worker starts.

ONNX Runtime (worker/onnx_engine.py) runs the families pollen exports, ONNX_FAMILIES (BERT, RoBERTa,
XLM-R and DistilBERT encoders, MPNet), in float32, with their heads (rerankers, classifiers, SPLADE)
and Dense modules; torch (worker/eager_engine.py) runs every other model, and any model under
--cpu-engine torch. A model on ONNX Runtime needs its export: made here once per checkpoint, in a
child process (`python -m pollen.worker.export`, which imports torch so the workers need not),
and kept in --onnx-cache for every later start (common/onnx_cache.py). With --cpu-engine auto a
model whose export fails runs on torch, and the log says why; with onnx the server does not start.
"""
from __future__ import annotations

import logging

from pollen.common import onnx_cache
from pollen.common.model_spec import ModelSpec, UnsupportedModel
from pollen.server.config import ServeConfig

log = logging.getLogger("pollen")

ONNX_FAMILIES = ("bert", "mpnet")


def onnx_refusal(spec: ModelSpec, dtype: str) -> str | None:
    """Why ONNX Runtime cannot run the model in `dtype` (the worker's); None where it can."""
    if spec.family not in ONNX_FAMILIES:
        return f"pollen exports the BERT and MPNet families to ONNX, and this model is of the {spec.family} family"
    if spec.bge_m3:
        return "BGE-M3's heads (sparse and ColBERT outputs) are not exported"
    if dtype != "float32":
        return f"the export is float32, and --dtype is {dtype}"
    return None


def prepare(cfg: ServeConfig, specs: list[ModelSpec]) -> None:
    """Set cfg.onnx_exports (each model's export folder, or "" where torch runs it), exporting what
    the cache lacks, and log which engine runs each model and why. UnsupportedModel where
    --cpu-engine onnx names a model ONNX Runtime cannot run, or whose export fails."""
    if cfg.device != "cpu":
        return
    wanted = cfg.cpu_engines()
    candidates = []  # (index, spec) of the models ONNX Runtime can run
    for index, (spec, engine) in enumerate(zip(specs, wanted)):
        refusal = "--cpu-engine torch" if engine == "torch" else onnx_refusal(spec, cfg.worker_dtype())
        if refusal and engine == "onnx":
            raise UnsupportedModel(f"{spec.path}: --cpu-engine onnx is refused: {refusal}")
        if refusal:
            log.info("model %s: CPU engine torch (%s)", spec.name, refusal)
        else:
            candidates.append((index, spec))
    folders = [""] * len(specs)
    if candidates:
        folder = cfg.onnx_cache or onnx_cache.default_folder()

        def announce(missing: list[ModelSpec]) -> None:
            log.info("exporting %s to ONNX (once; kept in %s) ...", ", ".join(s.name for s in missing), folder)

        try:
            exports = onnx_cache.pollen_exports([spec for _, spec in candidates], folder, announce)
        except OSError as exc:  # the cache cannot be written (a read-only home, a full disk)
            exports = [onnx_cache.Export("", error=f"the cache {folder} cannot hold it: {exc}")] * len(candidates)
        for (index, spec), export in zip(candidates, exports):
            folders[index] = _logged(spec, export, wanted[index])
    cfg.onnx_exports = ",".join(folders)


def _logged(spec: ModelSpec, export: onnx_cache.Export, wanted: str) -> str:
    """The export's folder, its engine logged; "" (torch) where it failed, or UnsupportedModel
    under --cpu-engine onnx."""
    if export.error:
        if wanted == "onnx":
            raise UnsupportedModel(f"{spec.path}: --cpu-engine onnx: its ONNX export failed: {export.error}")
        log.warning("model %s: CPU engine torch: its ONNX export failed (%s)", spec.name, export.error)
        return ""
    how = f"exported in {export.seconds:.1f} s" if export.made else "its export found"
    log.info("model %s: CPU engine onnx, ONNX Runtime (%s): %s", spec.name, how, export.path)
    return export.path
