"""A worker process: `python -m pollen.worker '<WorkerConfig as JSON>'`, started by the supervisor.

One worker per device. It sees and allocates on its one GPU (CUDA_VISIBLE_DEVICES narrowed before
torch starts), runs on its share of the cores, names itself in its process title, dies with its
parent, loads the model and pays its first-call costs, then runs the loop (worker/loop.py) over
its end of each frontend's ring pair (the control socket brings them).
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import traceback

from pollen.common import control
from pollen.common.process import bootstrap, config_from_argv
from pollen.common.worker_config import WorkerConfig


def load(cfg: WorkerConfig):
    """The model on this worker's device and the engine that runs it, warmed up; (engine, spec)."""
    import torch

    from pollen.worker.engine import make_engine
    from pollen.worker.models.loader import load_model

    torch.set_num_threads(cfg.threads)
    # cuda: main() narrowed CUDA_VISIBLE_DEVICES to our one GPU, so it is always cuda:0 here.
    device = "cuda:0" if cfg.device == "cuda" else "cpu"
    model = load_model(cfg.model, device=device, dtype=getattr(torch, cfg.dtype), pooling=cfg.pooling,
                       attention=cfg.attention, options=cfg.engine_options)
    engine = make_engine(model, device, max_batch_tokens=cfg.max_batch_tokens, cuda_graphs=cfg.cuda_graphs,
                         graph_max_tokens=cfg.graph_max_tokens or None, defer_capture=True,
                         bulk_sms=cfg.bulk_sms)
    # First-call costs, and on CUDA the likely query graphs, before READY rather than on a client.
    engine.warm_up(cfg.warmup_seconds)
    return engine, model.spec


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
    bootstrap(f"pollen-worker[{cfg.index}] {where} {os.path.basename(cfg.model)}", cfg.cpu_cores,
              ignore=(signal.SIGINT, signal.SIGTERM))
    import torch

    from pollen.worker.loop import Worker

    try:
        loaded = load(cfg)
    except Exception as exc:
        report_failure(cfg, exc)
        return 1
    worker = Worker(cfg, *loaded)
    try:
        # One inference mode around the whole loop: entering it for each batch costs every batch
        # time, the more on a core that had idled.
        with torch.inference_mode():
            worker.run()
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
