#!/usr/bin/env bash
# GPU runs on the device machine: `bash load/device_gpu.sh tests|bench ARGS...` with carry [".whl"].
# .whl/ holds the wheels that machine lacks (see load/device_smoke.sh for the download command;
# add msgspec==0.23.0 to that list).
#   tests:  the GPU tests (kernels, CUDA engine, Qwen3 vs HF) and the CPU model tests
#   bench:  python load/bench_engine.py ARGS (writes $OUT/...)
#   skinny: python load/bench_skinny_linear.py ARGS (the query kernels' tile table)
#   e2e:    python load/bench_e2e.py ARGS
set -o pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null || exit 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
what=$1; shift
case $what in
  tests) nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
         python3 -c "import torch, inspect; from torch.nn.attention.varlen import varlen_attn as v; print(torch.__version__, inspect.signature(v))"
         timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_engine.py tests/test_cuda_ring.py tests/test_model_qwen3.py tests/test_batcher.py "$@" 2>&1 | tail -30 ;;
  bench) python3 load/bench_engine.py "$@" ;;
  e2e) python3 load/bench_e2e.py "$@" ;;
  skinny) python3 load/bench_skinny_linear.py "$@" ;;
esac
