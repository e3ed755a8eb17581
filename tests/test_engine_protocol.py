"""Every engine is what the worker loop asks of one (worker/engine.py, Engine): every method
of the Protocol, with its parameters, and its attributes. Runs without a GPU (the CUDA engine's
class is read, not built)."""
from __future__ import annotations

import inspect

import pytest

from pollen.worker.cuda_engine import CudaEngine
from pollen.worker.eager_engine import EagerEngine
from pollen.worker.engine import Engine
from pollen.worker.onnx_engine import OnnxEngine

METHODS = [name for name, value in vars(Engine).items() if not name.startswith("_") and callable(value)]


def test_the_protocol_names_what_the_loop_uses():
    assert set(METHODS) == {"submit", "between_batches", "keep_counts_in", "register_host_memory",
                            "unregister_host_memory", "warm_up", "close"}
    assert set(Engine.__annotations__) == {"side_by_side", "bulk_sms"}


@pytest.mark.parametrize("engine", [EagerEngine, OnnxEngine, CudaEngine])
def test_each_engine_has_every_method_with_the_protocol_s_parameters(engine):
    for name in METHODS:
        assert list(inspect.signature(getattr(engine, name)).parameters) == \
            list(inspect.signature(getattr(Engine, name)).parameters), f"{engine.__name__}.{name}"


def test_the_cpu_engines_are_engines():
    for engine in (EagerEngine, OnnxEngine):
        assert isinstance(object.__new__(engine), Engine)
        assert engine.side_by_side is False
    assert CudaEngine.side_by_side is True


def test_make_engine_takes_every_option_of_each_engine_by_name_and_type():
    """make_engine's options are typed parameters, not **options: each is one of the CUDA engine's
    or the CPU engine's, with the same default, so none is dropped or renamed on the way."""
    from pollen.worker.engine import make_engine

    made = inspect.signature(make_engine).parameters
    assert all(p.kind is not p.VAR_KEYWORD for p in made.values())
    theirs = {**{k: v for k, v in inspect.signature(EagerEngine).parameters.items() if k != "model"},
              **{k: v for k, v in inspect.signature(CudaEngine).parameters.items() if k not in ("model", "device")}}
    ours = {k: v for k, v in made.items() if k not in ("model", "device")}
    assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
    for name, p in ours.items():
        assert p.default == theirs[name].default, name
