#!/usr/bin/env bash
# Issue 11's acceptance figures in one device call (about 9 minutes; device time is scarce):
#   run(command="bash load/device_acceptance.sh", carry=[".whl"], timeout_s=600)
# STEPS="tests concurrency" bash load/device_acceptance.sh runs only those steps (two calls fit
# the whole set into the device tool's 10-minute limit with room to spare).
# Each step has its own time limit, so one that overruns costs only itself. Leaves under $OUT the
# tables (tests.txt, concurrency.md, mixed.md, one.md, hops.md), the log, and json.tgz with every JSON:
# at most 8 files, as the device tool returns. What each step is: load/device_gpu.sh.
#   tests        the GPU tests
#   concurrency  unary, streams and HTTP at 1, 128, 512 and 512 clients, and the cold start; unary
#                from h2load too (a native client) where .whl/h2load is carried
#   mixed        one interactive client under a bulk stream, and docs through EmbedStream
#   one          one client at a time, grpc's blocking stub and grpc.aio, with the defaults and
#                with the frontends' spin off (--frontend-spin-us 0)
#   hops         one query's time, hop by hop (load/bench_query_hops.py)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
log=$OUT/log.txt
steps=" ${STEPS:-tests concurrency mixed one hops} "
kinds=unary,stream,http
[ -x .whl/h2load/h2load ] && kinds=$kinds,unary-h2load
step() {  # step SECONDS NAME ARGS...: one device_gpu.sh mode, its exit status in the log
    local seconds=$1 name=$2
    shift 2
    [[ $steps == *" $name "* ]] || return 0
    (timeout "$seconds" bash load/device_gpu.sh "$@") >>"$log" 2>&1
    echo "$name rc $?" >>"$log"
}
step 180 tests tests
grep -E "passed|failed" "$log" | tail -1 >"$OUT/tests.txt" 2>/dev/null
step 220 concurrency concurrency --clients 1,128,512,512 --kinds $kinds --seconds 4 --skip-engine \
    --out "$work/concurrency"
step 100 mixed mixed --seconds 6 --interactive-clients 1 --out "$work/mixed"
step 110 one one --frontends 0 --calls 1500 --clients sync,aio --server-flags "" --server-flags "--frontend-spin-us 0" \
    --out "$work/one"
step 80 hops hops --calls 2000 --out "$work/hops"
cp "$work"/*.md "$OUT"/ 2>/dev/null
(cd "$work" && tar czf "$OUT/json.tgz" ./*.json)
grep -E " rc |passed|failed" "$log"
