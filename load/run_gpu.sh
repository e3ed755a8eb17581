#!/usr/bin/env bash
# The GPU tests, then the GPU benchmarks behind the README's Performance rows, on a host with a CUDA
# GPU and pollen installed with its test extra (`pip install -e '.[test]'`). Each benchmark replaces
# its result file, load/results/<benchmark>-gpu-<model>.md (load/results_file.py).
#
#   POLLEN_QWEN3_TOKENIZER=/path/to/tokenizer.json bash load/run_gpu.sh
#   STEPS="engine e2e" bash load/run_gpu.sh
#
# Steps, all by default, in this order: tests engine e2e concurrency mixed one_client tokenize
# rerank two_models models sparse fp8.
# The models are random weights in the real shapes (load/gpu_models.py, load/arch_models.py, written once under
# /tmp/pollen-ckpt); the servers tokenize with the real Qwen3 tokenizer.json, which
# POLLEN_QWEN3_TOKENIZER names (concurrency, mixed, one_client, tokenize, rerank, two_models and
# models need it; tokenize, rerank and two_models also a BERT tokenizer directory, POLLEN_BERT_TOKENIZER_DIR, which
# models and sparse use too; sparse needs no Qwen3
# tokenizer: its SPLADE and bge-m3 shapes take the BERT one; fp8 needs the Qwen3 tokenizer and reads
# all-MiniLM-L6-v2 from its installed package, or POLLEN_MINILM_DIR). With h2load on
# PATH (Debian/Ubuntu: nghttp2-client), concurrency also measures unary calls from it. A failed
# step does not stop the ones after it; the exit status says whether any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$(command -v python || command -v python3)}
steps=" ${STEPS:-tests engine e2e concurrency mixed one_client tokenize rerank two_models models sparse fp8} "
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
tok=(--tokenizer "${POLLEN_QWEN3_TOKENIZER:-}")
for name in concurrency mixed one_client tokenize rerank two_models models fp8; do
    if [[ $steps == *" $name "* && ! -f ${POLLEN_QWEN3_TOKENIZER:-} ]]; then
        echo "$name needs POLLEN_QWEN3_TOKENIZER, the real Qwen3 tokenizer.json" >&2
        exit 2
    fi
done
kinds=unary,stream,http
command -v h2load >/dev/null && kinds=$kinds,unary-h2load
failed=""

step() {  # step NAME COMMAND...: runs it when STEPS names it
    local name=$1
    shift
    [[ $steps == *" $name "* ]] || return 0
    echo "== $name: $*"
    "$@" || failed="$failed $name"
}

step tests "$py" -m pytest -q -m gpu tests
step engine "$py" load/bench_engine.py --shapes qwen3-0.6b,qwen3-4b,bert-base
step e2e "$py" load/bench_e2e.py --shape qwen3-0.6b
step concurrency "$py" load/bench_concurrency.py "${tok[@]}" --clients 1,128,512 --kinds "$kinds" --seconds 4 --skip-engine
step mixed "$py" load/bench_mixed.py "${tok[@]}" --seconds 6 --interactive-clients 1
step one_client "$py" load/bench_one_client.py "${tok[@]}" --frontends 0 --calls 1500 --clients sync,aio,http
step tokenize "$py" load/bench_rerank.py --tokenize --bert-tokenizer "${POLLEN_BERT_TOKENIZER_DIR:-}" \
    --qwen3-tokenizer "${POLLEN_QWEN3_TOKENIZER:-}"
step rerank "$py" load/bench_rerank.py --bert-tokenizer "${POLLEN_BERT_TOKENIZER_DIR:-}" \
    --qwen3-tokenizer "${POLLEN_QWEN3_TOKENIZER:-}"
step two_models "$py" load/bench_two_models.py --bert-tokenizer "${POLLEN_BERT_TOKENIZER_DIR:-}" \
    --qwen3-tokenizer "${POLLEN_QWEN3_TOKENIZER:-}"
step models "$py" load/bench_models.py --bert-tokenizer "${POLLEN_BERT_TOKENIZER_DIR:-}" \
    --qwen3-tokenizer "${POLLEN_QWEN3_TOKENIZER:-}"
step sparse "$py" load/bench_sparse.py --bert-tokenizer "${POLLEN_BERT_TOKENIZER_DIR:-}"
step fp8 "$py" load/bench_fp8.py --qwen3-tokenizer "${POLLEN_QWEN3_TOKENIZER:-}" \
    ${POLLEN_MINILM_DIR:+--minilm "$POLLEN_MINILM_DIR"}

if [[ -n $failed ]]; then
    echo "failed:$failed" >&2
    exit 1
fi
echo "all steps passed"
