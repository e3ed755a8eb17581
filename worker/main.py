"""A worker process: `python -m pollen.worker '<WorkerConfig as JSON>'`, started by the supervisor.

One worker per device. It sees and allocates on its one GPU (CUDA_VISIBLE_DEVICES narrowed before
torch starts), runs on its share of the cores, names itself in its process title, dies with its
parent, loads every model (an engine each) and pays their first-call costs, then runs the loop (worker/loop.py) over
its end of each frontend's ring pair (the control socket brings them).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import traceback

from pollen.common import control
from pollen.common.process import bootstrap, config_from_argv
from pollen.common.worker_config import WorkerConfig
from pollen.worker.model_slot import ModelSlot


def load(cfg: WorkerConfig) -> list[ModelSlot]:
    """Every model on this worker's device, each with the engine that runs it, warmed up, in
    --model's order; each model's memory is logged (and the READY record reports it). torch is
    imported only where a model runs on it: a CPU worker whose models all run on ONNX Runtime
    never loads it."""
    paths = cfg.model.split(",")
    if any(not cfg.onnx_export_of(index) for index in range(len(paths))):
        import torch

        torch.set_num_threads(cfg.threads)
    # cuda: main() narrowed CUDA_VISIBLE_DEVICES to our one GPU, so it is always cuda:0 here.
    device = "cuda:0" if cfg.device == "cuda" else "cpu"
    return [load_onnx(cfg, index, path, len(paths)) if cfg.onnx_export_of(index) else
            load_one(cfg, index, path, device, several=len(paths) > 1) for index, path in enumerate(paths)]


def load_onnx(cfg: WorkerConfig, index: int, path: str, models: int) -> ModelSlot:
    """One model on ONNX Runtime, from the export the supervisor made (server/process/cpu_engines.py),
    warmed up; its memory: what the process's resident set grew by while its sessions were made
    and warmed (their weights, packed for the kernels, and the warm-up's activations)."""
    from pollen.common.model_spec import read_model_spec
    from pollen.worker.onnx_engine import OnnxEngine

    spec = read_model_spec(path, pooling=cfg.pooling, attention=cfg.attention, task=cfg.task_of(index))
    before = resident_bytes()
    engine = OnnxEngine(spec, cfg.onnx_export_of(index), cfg.threads, cfg.adapt_worker_threads,
                        cfg.engine_options.cpu_pieces, cfg.engine_options.onnx_spin)
    engine.warm_up(cfg.warmup_seconds / models)
    memory = resident_bytes() - before
    print(f"pollen-worker[{cfg.index}]: model {index} ({os.path.basename(path)}) holds {memory / 2**20:.0f} MiB "
          f"on cpu, ONNX Runtime ({engine.weights_bytes() / 2**20:.0f} MiB export, "
          f"{len(engine.encoders)} session(s))", file=sys.stderr, flush=True)
    return ModelSlot(index, spec, engine, memory)


def resident_bytes() -> int:
    """This process's resident set (VmRSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def load_one(cfg: WorkerConfig, index: int, path: str, device: str, several: bool = False) -> ModelSlot:
    """One model and its engine (its own graphs, buffers and streams), warmed up; its memory:
    on CUDA what the GPU's allocator holds for it once warm (weights, buffers, captured graphs),
    on the CPU its weights.

    Beside other models, a reranker's or classifier's interactive stream runs one priority step
    below an embedder's (both above every bulk lane): one pair batch is many times a query's
    work, and at equal priority the GPU interleaves their kernels one for one, so each of a
    query's kernels would wait for one of the batch's."""
    import torch

    from pollen.worker.engine import make_engine
    from pollen.worker.models.loader import load_model

    cuda = device.startswith("cuda")
    before = torch.cuda.memory_reserved(device) if cuda else 0
    model = load_model(path, device=device, dtype=getattr(torch, cfg.dtype), pooling=cfg.pooling,
                       attention=cfg.attention, task=cfg.task_of(index), options=cfg.engine_options,
                       quantization=cfg.quantization_of(index), sparse_max_terms=cfg.sparse_max_terms)
    engine = make_engine(model, device, threads=cfg.threads, adapt_threads=cfg.adapt_worker_threads,
                         pieces=cfg.engine_options.cpu_pieces, max_batch_tokens=cfg.max_batch_tokens,
                         cuda_graphs=cfg.cuda_graphs, graph_max_tokens=cfg.graph_max_tokens or None, defer_capture=True,
                         bulk_sms=cfg.bulk_sms, interactive_step=int(several and model.spec.task != "embed"))
    if model.fp8_choice is not None:  # as the engine aligned it to its graph buckets
        print(f"pollen-worker[{cfg.index}]: model {index} ({os.path.basename(path)}): "
              f"{model.fp8_choice.describe()}", file=sys.stderr, flush=True)
    # First-call costs, and on CUDA the likely query graphs, before READY rather than on a client.
    # Several models share the warm-up budget.
    engine.warm_up(cfg.warmup_seconds / len(cfg.model.split(",")))
    # On the CPU, packed weights are buffers (worker/models/cpu_linear.py).
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    memory = torch.cuda.memory_reserved(device) - before if cuda else weights
    print(f"pollen-worker[{cfg.index}]: model {index} ({os.path.basename(path)}) holds {memory / 2**20:.0f} MiB "
          f"on {device} ({weights / 2**20:.0f} MiB of weights)", file=sys.stderr, flush=True)
    return ModelSlot(index, model.spec, engine, memory)


def report_failure(cfg: WorkerConfig, exc: Exception) -> None:
    """Tell the supervisor why the model could not be loaded: its last line says so. A fault of
    the model's files (UnsupportedModel, a safetensors error) needs nothing more; anything else
    leaves its traceback in the log too."""
    from safetensors import SafetensorError

    from pollen.common.model_spec import UnsupportedModel

    error = str(exc) if isinstance(exc, UnsupportedModel) else f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, UnsupportedModel | SafetensorError):
        traceback.print_exc()
    with socket.socket(fileno=os.dup(cfg.control_fd)) as sock:
        control.send(sock, {"kind": "failed", "error": error})


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv(WorkerConfig, argv, "pollen.worker")
    if cfg.gpu >= 0:
        # Before torch initializes CUDA: this process sees, allocates on and names one GPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.cuda_device
    where = f"cuda:{cfg.gpu}" if cfg.gpu >= 0 else "cpu"
    # SIGTERM and SIGINT are the supervisor's: it stops us over the control socket once the
    # frontends have finished their calls.
    names = " ".join(os.path.basename(path) for path in cfg.model.split(","))
    bootstrap(f"pollen-worker[{cfg.index}] {where} {names}", cfg.cpu_cores,
              ignore=(signal.SIGINT, signal.SIGTERM))
    from pollen.worker.loop import Worker

    try:
        loaded = load(cfg)
    except Exception as exc:
        report_failure(cfg, exc)
        return 1
    worker = Worker(cfg, loaded)
    try:
        with loop_context():
            worker.run()
    finally:
        worker.close()
    return 0


def loop_context():
    """One torch inference mode around the whole loop where a model runs on torch: entering it for
    each batch costs every batch time, the more on a core that had idled. None where no model
    does (load imported torch only then)."""
    torch = sys.modules.get("torch")
    return torch.inference_mode() if torch is not None else contextlib.nullcontext()


if __name__ == "__main__":
    sys.exit(main())
