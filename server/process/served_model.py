"""The models as this server serves them: each --model resolved to a local directory, its spec read,
and the server-wide settings that change what requests get applied to that spec.

`prepare` runs once, in the supervisor (server/process/app.py), before anything reads a model: a Hub id
becomes its snapshot directory in the Hugging Face cache (common/model_source.py) and cfg.model
holds those directories from then on, so the frontends and workers (started with cfg) read local
files only. `served_specs` is what every process that answers requests reads: the frontends call
it with the resolved cfg; the workers read each spec with the same --task (WorkerConfig.task_of),
so both sides agree on every model's task and head. A model's place in the list is its index in a
request record (common/request.py, RequestOptions.model).
"""
from __future__ import annotations

import dataclasses
import logging

from pollen.common import model_source
from pollen.common.model_spec import ModelSpec, UnsupportedModel, read_model_spec
from pollen.server.config import ServeConfig

log = logging.getLogger("pollen")


def prepare(cfg: ServeConfig) -> list[ModelSpec]:
    """Resolve each of cfg.model's models to a local directory (setting cfg.model, and each
    served name that is unset to the model's Hub id), then read and check the served specs.
    Refusals are ValueErrors with one clear message."""
    paths, names = [], cfg.served_names()
    for i, model in enumerate(cfg.model_paths()):
        path, hub_id = model_source.resolve(model, cfg.revision)
        if hub_id is not None:
            log.info("model %s%s is %s", hub_id, f" at revision {cfg.revision}" if cfg.revision else "", path)
            names[i] = names[i] or hub_id
        paths.append(path)
    cfg.model = ",".join(paths)
    cfg.served_model_name = ",".join(name or "" for name in names) if any(names) else None
    specs = served_specs(cfg)
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.name in seen:
            raise UnsupportedModel(f"two models are served as {spec.name!r} ({seen[spec.name]} and {spec.path}); "
                                   "name them apart with --served-model-name")
        seen[spec.name] = spec.path
    for spec in specs:
        log.info("model %s: task %s, %s", spec.name, spec.task, spec.task_reason)
    return specs


def served_specs(cfg: ServeConfig) -> list[ModelSpec]:
    """Each model's spec, in --model's order, with --served-model-name's name in place of the
    checkpoint's (ModelSpec.name is what Info, /v1/models and the answers report and what a
    request's model field names), the task --task gives it (the checkpoint's with auto) and, for a
    lone model, --pooling, --attention and --default-prompt-name (ServeConfig.check_models refuses
    them beside others)."""
    return [_served_spec(cfg, path, name, task)
            for path, name, task in zip(cfg.model_paths(), cfg.served_names(), cfg.tasks())]


def _served_spec(cfg: ServeConfig, path: str, name: str | None, task: str) -> ModelSpec:
    spec = read_model_spec(path, pooling=cfg.pooling, attention=cfg.attention, task=task,
                           sparse_max_terms=cfg.sparse_max_terms)
    changes = {}
    if cfg.default_prompt_name:
        prompts = dict(spec.prompts)
        if cfg.default_prompt_name not in prompts:
            known = ", ".join(sorted(prompts)) if prompts else "none (the model defines no prompts)"
            raise UnsupportedModel(f"--default-prompt-name {cfg.default_prompt_name!r} is not one of the model's "
                                   f"prompts; known: {known}")
        changes["default_prompt_name"] = cfg.default_prompt_name
    if name:
        changes["name"] = name
    return dataclasses.replace(spec, **changes) if changes else spec
