"""The GPU settings as the frontend reads them, checked where no GPU is present: which GPUs get a
worker, how the CPU cores are shared out, and the clear errors for settings that cannot work."""
from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest

from pollen.common.engine_options import EngineOptions
from pollen.common.worker_config import WorkerConfig
from pollen.server.config import ServeConfig, visible_device
from pollen.server.process.supervisor import core_share, frontend_cores, worker_cores
from pollen.worker.sm_partition import bulk_sm_count


def test_devices_give_one_worker_each():
    cfg = ServeConfig.from_args(["--device", "cuda", "--devices", "1, 3"], environ={})
    assert cfg.workers == 2 and cfg.gpu_list() == [1, 3] and cfg.devices == "1,3"
    assert cfg.worker_dtype() == "bfloat16"
    assert ServeConfig.from_args([], environ={}).worker_dtype() == "float32"
    env = {"POLLEN_DEVICE": "cuda", "POLLEN_DEVICES": "0", "POLLEN_DTYPE": "float16", "POLLEN_CUDA_GRAPHS": "off"}
    cfg = ServeConfig.from_args([], environ=env)
    assert (cfg.workers, cfg.worker_dtype(), cfg.cuda_graphs) == (1, "float16", "off")


@pytest.mark.parametrize("args,message", [
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--devices", "0"], "needs --device cuda"),
    (["--device", "cuda", "--devices", "0,0"], "distinct"),
    (["--device", "cuda", "--devices", "a"], "GPU indices"),
    (["--dtype", "float64"], "--dtype"),
    (["--cuda-graphs", "maybe"], "--cuda-graphs"),
])
def test_impossible_gpu_settings_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig.from_args(args, environ={})


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(ValueError, match="no GPU is visible"):
        ServeConfig.from_args(["--device", "cuda"], environ={})


def test_cores_are_cut_into_even_slices():
    cores = sorted(os.sched_getaffinity(0))
    assert core_share(0, 1) == cores
    if len(cores) >= 2:
        halves = [core_share(i, 2) for i in range(2)]
        assert halves[0] and halves[1] and not set(halves[0]) & set(halves[1])
        assert len(halves[0]) == len(halves[1]) == len(cores) // 2
    assert core_share(0, len(cores) + 1) == cores  # more workers than cores: all share all


def test_gpu_workers_and_frontends_get_cores_apart():
    # Only the fields these plans read; a real ServeConfig cannot say --device cuda without a GPU.
    cores = list(range(16))
    one, two = SimpleNamespace(device="cuda", workers=1), SimpleNamespace(device="cuda", workers=2)
    assert worker_cores(one, 0, cores) == [14, 15]
    assert frontend_cores(one, cores) == list(range(14))
    assert [worker_cores(two, w, cores) for w in (0, 1)] == [[14, 15], [12, 13]]
    assert frontend_cores(two, cores) == list(range(12))
    assert frontend_cores(SimpleNamespace(device="cuda", workers=1), [0, 1]) == []  # too few to set apart
    assert frontend_cores(SimpleNamespace(device="cpu", workers=1), cores) == []  # CPU workers share


def test_worker_config_round_trips_the_gpu_settings():
    cfg = WorkerConfig(index=1, model="/m", device="cuda", threads=2, max_batch_tokens=4096, parent_pid=1,
                       control_fd=7, state="pollen-1-ab", response_ring_bytes=1 << 20, gpu=3, cuda_device="6",
                       cpu_cores=[4, 5], dtype="bfloat16", cuda_graphs=False, graph_max_tokens=2048,
                       pooling="mean", attention="bidirectional", bulk_sms=100,
                       engine_options=EngineOptions(triton=False, skinny=False, skinny_configs=__file__))
    back = WorkerConfig(**json.loads(cfg.to_json()))
    assert back == cfg and isinstance(back.engine_options, EngineOptions)
    assert WorkerConfig(**json.loads(dataclasses.replace(cfg, engine_options=EngineOptions()).to_json())) \
        .engine_options == EngineOptions()


def test_engine_options_are_hidden_flags_and_variables(capsys):
    """Each EngineOptions field is a flag and a POLLEN_* variable (POLLEN_TRITON=0 is --triton 0), kept
    off --help; ServeConfig builds the EngineOptions the workers get."""
    assert ServeConfig.from_args([], environ={}).engine_options() == EngineOptions()
    env = {"POLLEN_TRITON": "0", "POLLEN_SHORT_ATTENTION": "0", "POLLEN_SKINNY": "0", "POLLEN_FLASH_ATTN": "0",
           "POLLEN_FOLD_NORMS": "0", "POLLEN_SKINNY_CONFIGS": __file__}
    assert ServeConfig.from_args([], environ=env).engine_options() == EngineOptions(
        triton=False, short_attention=False, skinny=False, skinny_configs=__file__, flash_attn=False,
        fold_norms=False)
    cfg = ServeConfig.from_args(["--skinny", "1", "--fold-norms", "off"], environ={"POLLEN_SKINNY": "0"})
    assert (cfg.skinny, cfg.fold_norms, cfg.triton) == (True, False, True)
    assert ServeConfig.from_args([], environ={"POLLEN_SKINNY_CONFIGS": ""}).engine_options().skinny_configs is None
    with pytest.raises(ValueError, match="no such file"):
        ServeConfig.from_args(["--skinny-configs", "/nonexistent/table.json"], environ={})
    with pytest.raises(ValueError, match="expected 1/0"):
        ServeConfig.from_args([], environ={"POLLEN_TRITON": "maybe"})
    with pytest.raises(SystemExit):
        ServeConfig.from_args(["--help"], environ={})
    shown = capsys.readouterr().out
    assert "--max-batch-tokens" in shown
    for field in dataclasses.fields(EngineOptions):
        assert "--" + field.name.replace("_", "-") not in shown


def test_engine_options_parse_and_serve_flags():
    options = EngineOptions.parse("skinny=0, short_attention=off,skinny_configs=" + __file__)
    assert options == EngineOptions(skinny=False, short_attention=False, skinny_configs=__file__)
    assert EngineOptions.parse("") == EngineOptions() and EngineOptions().serve_flags() == []
    cfg = ServeConfig.from_args(options.serve_flags(), environ={})
    assert cfg.engine_options() == options
    for bad in ("skinny", "turbo=1", "triton=2"):
        with pytest.raises(ValueError):
            EngineOptions.parse(bad)


def test_worker_gpu_is_read_through_the_servers_own_visible_devices():
    assert visible_device(1, None) == "1"
    assert visible_device(1, "") == "1"
    assert visible_device(1, "4, 6") == "6"  # the frontend's GPU 1 is physical GPU 6
    assert visible_device(0, "GPU-3f2a") == "GPU-3f2a"
    with pytest.raises(ValueError, match="not among"):
        visible_device(2, "4,6")


def test_usable_cores_follow_the_cgroup_quota(tmp_path):
    from pollen.server.config import usable_cores

    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # a container's --cpus 1.5: two cores to plan with
    assert usable_cores(str(cpu_max)) == min(affinity, 2)
    cpu_max.write_text("max 100000\n")
    assert usable_cores(str(cpu_max)) == affinity
    assert usable_cores(str(tmp_path / "absent")) == affinity


def test_bulk_sms_default_leaves_an_eighth_of_the_sms_to_queries():
    """--bulk-sms: -1 (default) keeps an eighth of the SMs, at least 8, out of the bulk lane's green
    context where torch has green contexts, else none; 0 is every SM; a count must leave some."""
    assert ServeConfig.from_args([], environ={}).bulk_sms == -1
    assert ServeConfig.from_args([], environ={"POLLEN_BULK_SMS": "96"}).bulk_sms == 96
    with pytest.raises(ValueError, match="--bulk-sms must be"):
        ServeConfig.from_args(["--bulk-sms", "-2"], environ={})
    assert bulk_sm_count(-1, 132, True) == 116    # H100 / H200
    assert bulk_sm_count(-1, 40, True) == 32      # T4: 8 left
    assert bulk_sm_count(-1, 16, True) == 0       # too small to split
    assert bulk_sm_count(-1, 132, False) == 0     # no green contexts: every SM
    assert bulk_sm_count(0, 132, True) == 0
    assert bulk_sm_count(100, 132, True) == 100
    with pytest.raises(ValueError, match="this GPU has 132 SMs"):
        bulk_sm_count(132, 132, True)
    with pytest.raises(RuntimeError, match="needs CUDA green contexts"):
        bulk_sm_count(100, 132, False)


@pytest.mark.parametrize(("cores", "workers", "expected"), [
    (16, 1, 11),  # an H200 host: 14 cores left, 3 frontends for every 4
    (8, 1, 5),
    (4, 1, 2),
    (3, 1, 1),
    (2, 1, 1),    # no core left: still one frontend
    (64, 2, 16),  # at most 16
])
def test_default_frontends_take_three_of_every_four_cores_the_gpu_workers_leave(monkeypatch, cores, workers,
                                                                                expected):
    from pollen.server import config

    monkeypatch.setattr(config, "usable_cores", lambda: cores)
    assert config.default_frontends("cuda", workers) == expected
    assert config.default_frontends("cpu", workers) == 1
