#!/usr/bin/env bash
# real_shapes.sh's comparison cut to what a loaded shared 2-core machine finishes in ~30 min:
# for each server on FILE (hotprefix, then llama-server): start to /v1/models, idle RSS of its
# process group, the ttft workload with 2 output tokens (a cold 1,030-token prompt, then 5 warm
# ones on its 1,000-token prefix), single-stream decode (stream_decode.py: 16 tokens by the difference of two latencies, twice),
# shared (8 concurrent on a warm 1,000-token prefix, 8 tokens each). ONLY=llamaserver (or hotprefix): that server alone.
#
#   OUT=docs/bench/a3b bash benchmarks/a3b_short.sh FILE.gguf
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
FILE=$1
OUT=${OUT:-docs/bench/a3b}
PORT=${PORT:-8793}
PEERS=${PEERS:-benchmarks/peers}
TAG=$(basename "$FILE" .gguf); TAG=${TAG#random-}
mkdir -p "$OUT"
$PY benchmarks/run_facts.py "benchmarks/a3b_short.sh $FILE" > "$OUT/meta.json"
rss_group() { ps -o rss= -g "$1" | awk '{s += $1} END {printf "%.0f\n", s * 1024}'; }
STARTED=()
stop_all() { local p; for p in "${STARTED[@]}"; do kill -- -"$p" 2>/dev/null || true; done; }
trap stop_all EXIT
run() {  # SERVER COMMAND...
  local server=$1; shift
  [ -z "${ONLY:-}" ] || [ "$ONLY" = "$server" ] || return 0
  local url="http://127.0.0.1:$PORT" t0
  t0=$(date +%s.%N)
  setsid "$@" >> "$OUT/$TAG-$server-serve.log" 2>&1 &
  local pid=$!; STARTED+=("$pid")
  until curl -sf "$url/v1/models" >/dev/null; do kill -0 $pid 2>/dev/null || { echo "$server died" >&2; return 1; }; sleep 0.2; done
  [ -f "$OUT/$TAG-$server-start.json" ] ||
    echo "{\"server_start_s\": $(echo "$(date +%s.%N) - $t0" | bc)}" > "$OUT/$TAG-$server-start.json"
  sleep 2
  [ -f "$OUT/$TAG-$server-rss.json" ] || echo "{\"idle_rss_bytes\": $(rss_group $pid)}" > "$OUT/$TAG-$server-rss.json"
  [ -f "$OUT/$TAG-$server-ttft.json" ] ||  # a step done by an earlier run is not run again
    .venv/bin/hotprefix bench "$url" --workload ttft --max-tokens 2 --json "$OUT/$TAG-$server-ttft.json" > /dev/null
  [ -f "$OUT/$TAG-$server-decode.json" ] || $PY benchmarks/stream_decode.py "$url" --json "$OUT/$TAG-$server-decode.json" > /dev/null
  if [ ! -f "$OUT/$TAG-$server-shared.json" ]; then
    .venv/bin/hotprefix bench "$url" --workload shared --max-tokens 8 --json "$OUT/$TAG-$server-shared.json" > /dev/null
  fi
  kill -- -"$pid"; wait "$pid" 2>/dev/null || true
}
run hotprefix .venv/bin/hotprefix serve --model "$FILE" --port "$PORT" --kv-cache-memory 2GiB
# LLAMA_ARGS: more llama-server arguments (--no-repack where its AMX path crashes on the file)
# shellcheck disable=SC2086  # LLAMA_ARGS: a list of flags
run llamaserver bash "$PEERS/llamaserver.sh" serve "$PORT" -m "$FILE" -c 16384 ${LLAMA_ARGS:-}
