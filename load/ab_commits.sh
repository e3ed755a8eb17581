#!/usr/bin/env bash
# Two commits of pollen measured alternately on one GPU host (old, new, old, new, ...) on the
# figures a change must keep: the engine's docs tokens/s, docs end to end through EmbedStream, the
# query path (unary queries/s at 1, 32, 128 and 512 clients and 128 on one connection, the p99 at
# 128 and the whole server's CPU a query there: the guard against a slower query path) and one
# client's p50. Each commit is checked out into a temporary
# worktree and installed (`pip install --no-deps -e`) before its turn; both are measured by this
# checkout's load/ scripts, so the measuring code is the same. At the end the pollen that was
# installed before is installed again, and the side-by-side table (load/ab_report.py) is printed and
# written to load/results/ab-<kind>.md. Needs what load/run_gpu.sh needs, and git.
#
#   POLLEN_QWEN3_TOKENIZER=/path/to/tokenizer.json bash load/ab_commits.sh OLD NEW
#   ROUNDS=3 FIGURES="engine unary" ... bash load/ab_commits.sh OLD NEW
#
# OLD and NEW are commits (or directories holding a checkout). ROUNDS (default 2) is how many times
# each is measured; FIGURES (default: engine e2e unary one) which figures. On an H200 a commit's turn
# takes about 2 minutes, so the default is about 8 minutes. SHAPE (default qwen3-0.6b) is the model's shape
# (load/gpu_models.py); DEVICE=cpu SHAPE=qwen3-tiny FIGURES="unary one" checks this script without a GPU.
# SERVER_FLAGS (default none) go to both commits' servers for unary and one: e.g. a GPU host's
# frontend count and spins on the CPU, SERVER_FLAGS="--frontends 2 --frontend-spin-us 5000".
set -uo pipefail
[[ $# -eq 2 ]] || { sed -n '2,16p' "$0" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$(command -v python || command -v python3)}
rounds=${ROUNDS:-2}
figures=" ${FIGURES:-engine e2e unary one} "
shape=${SHAPE:-qwen3-0.6b}
server_flags=${SERVER_FLAGS:-}
device=${DEVICE:-cuda}
tok=${POLLEN_QWEN3_TOKENIZER:-}
if [[ ( $figures == *" unary "* || $figures == *" one "* ) && ! -f $tok ]]; then
    echo "unary and one need POLLEN_QWEN3_TOKENIZER, the real Qwen3 tokenizer.json" >&2
    exit 2
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
work=$(mktemp -d /tmp/pollen-ab.XXXXXX)
# The checkout pollen is installed from now (protos/pollen is the package's folder), put back at the end.
before=$("$py" -c 'import os, pollen; print(os.path.dirname(os.path.dirname(os.path.realpath(pollen.__path__[0]))))' 2>/dev/null)
[[ -f $before/pyproject.toml ]] || before=$repo

install() {  # install DIR: pollen from DIR, and check that it is what imports
    "$py" -m pip install -q --no-deps --no-build-isolation -e "$1" >"$work/pip.log" 2>&1 \
        || "$py" -m pip install -q --no-deps -e "$1" >>"$work/pip.log" 2>&1 \
        || { cat "$work/pip.log" >&2; return 1; }
    local got
    got=$(cd /tmp && "$py" -c 'import os, pollen; print(os.path.realpath(pollen.__path__[0]))')
    [[ $got == "$(realpath "$1")/protos/pollen" ]] || { echo "pollen imports from $got, not $1" >&2; return 1; }
}

checkout() {  # checkout NAME REF: a directory holding REF
    if [[ -d $2 ]]; then
        realpath "$2"
    else
        git -C "$repo" worktree add -q --detach "$work/$1" "$2" >&2 && echo "$work/$1"
    fi
}

cleanup() {
    install "$before" || echo "could not install pollen from $before again" >&2
    for side in old new; do
        [[ -d $work/$side ]] && git -C "$repo" worktree remove --force "$work/$side"
    done
    rm -rf "$work"
}
trap cleanup EXIT

old=$(checkout old "$1") || exit 1
new=$(checkout new "$2") || exit 1
label() {  # a checkout's commit, or its directory when it is no git checkout of its own
    if [[ -e $1/.git ]]; then git -C "$1" describe --always --dirty --abbrev=12; else echo "$1"; fi
}
old_label=$(label "$old") new_label=$(label "$new")

figure() {  # figure NAME OUT: one benchmark's quick run for the A/B, its result file in OUT
    local name=$1 out=$2
    [[ $figures == *" $name "* ]] || return 0
    case $name in
        engine) timeout 300 "$py" load/bench_engine.py --shapes "$shape" --docs-only --docs-scale 0.5 --out "$out" ;;
        e2e) timeout 300 "$py" load/bench_e2e.py --shape "$shape" --docs-only --docs-scale 0.5 --out "$out" ;;
        unary) timeout 300 "$py" load/bench_concurrency.py --shape "$shape" --device "$device" --tokenizer "$tok" \
                   --clients 1,32,128,512 --kinds unary,unary-one-connection --seconds 4 --skip-engine --skip-cold \
                   --server-flags "$server_flags" --out "$out" ;;
        one) timeout 300 "$py" load/bench_one_client.py --shape "$shape" --device "$device" --tokenizer "$tok" \
                 --frontends 0 --clients sync --calls 1000 --server-flags "$server_flags" --out "$out" ;;
    esac >"$out.log" 2>&1 || { echo "  $name failed (last lines of its log):" >&2; tail -5 "$out.log" >&2; }
}

cd "$repo"
for round in $(seq 1 "$rounds"); do
    for side in old new; do
        dir=${!side}
        echo "== round $round, $side ($(label "$dir"))"
        install "$dir" || exit 1
        for name in engine e2e unary one; do
            began=$SECONDS
            figure "$name" "$work/$name-$side-$round.md"
            [[ $figures == *" $name "* ]] && echo "  $name: $((SECONDS - began)) s"
        done
    done
done
"$py" load/ab_report.py "$work" "$old_label" "$new_label" \
    --command "ROUNDS=$rounds FIGURES=\"${figures:1:-1}\" SHAPE=$shape DEVICE=$device${server_flags:+ SERVER_FLAGS=\"$server_flags\"} bash load/ab_commits.sh $1 $2"
