"""The model as this server serves it: --model resolved to a local directory, its spec read, and
the server-wide settings that change what requests get applied to that spec.

`prepare` runs once, in the supervisor (server/app.py), before anything reads the model: a Hub
id becomes its snapshot directory in the Hugging Face cache (common/model_source.py) and
cfg.model is that directory from then on, so the frontends and workers (started with cfg) read
local files only. `served_spec` is what every process that answers requests reads: the frontends
call it with the resolved cfg.
"""
from __future__ import annotations

import dataclasses
import logging

from pollen.common import model_source
from pollen.common.model_spec import ModelSpec, UnsupportedModel, read_model_spec
from pollen.server.config import ServeConfig

log = logging.getLogger("pollen")


def prepare(cfg: ServeConfig) -> ModelSpec:
    """Resolve cfg.model to a local directory (setting cfg.model, and cfg.served_model_name to the
    Hub id when it names none), then read and check the served spec. Refusals are ValueErrors
    with one clear message."""
    path, hub_id = model_source.resolve(cfg.model, cfg.revision)
    if hub_id is not None:
        log.info("model %s%s is %s", hub_id, f" at revision {cfg.revision}" if cfg.revision else "", path)
        cfg.served_model_name = cfg.served_model_name or hub_id
    cfg.model = path
    return served_spec(cfg)


def served_spec(cfg: ServeConfig) -> ModelSpec:
    """cfg.model's spec with --pooling and --attention, and with --default-prompt-name and
    --served-model-name in place of the checkpoint's default prompt and name (ModelSpec.name is
    what Info, /v1/models and the HTTP answers report)."""
    spec = read_model_spec(cfg.model, pooling=cfg.pooling, attention=cfg.attention)
    changes = {}
    if cfg.default_prompt_name:
        prompts = dict(spec.prompts)
        if cfg.default_prompt_name not in prompts:
            known = ", ".join(sorted(prompts)) if prompts else "none (the model defines no prompts)"
            raise UnsupportedModel(f"--default-prompt-name {cfg.default_prompt_name!r} is not one of the model's "
                                   f"prompts; known: {known}")
        changes["default_prompt_name"] = cfg.default_prompt_name
    if cfg.served_model_name:
        changes["name"] = cfg.served_model_name
    return dataclasses.replace(spec, **changes) if changes else spec
