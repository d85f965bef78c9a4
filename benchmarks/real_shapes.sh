#!/usr/bin/env bash
# The models users run, both engines on the same file in one run: random-weight GGUFs of
# Llama-3.2-1B's and Llama-3.1-8B's shapes in Q4_0 and Q4_K_M, and 24 of Qwen3-30B-A3B's 48
# layers (a3b: a mixture of 128 experts, 8 a token) in Q4_K_M (benchmarks/make_gguf.py, which
# quantizes with llama.cpp's own llama-quantize), served by hotprefix and by llama.cpp's
# llama-server (benchmarks/peers/llamaserver.sh) one after the other.
#
#   bash benchmarks/real_shapes.sh [TAG ...]    TAG: 1b-Q4_K_M, gemma3-270m-Q4_K_M, a3b-Q4_K_M (default: 1b-Q4_K_M 1b-Q4_0 8b-Q4_K_M)
#
# $LLAMASERVER_ARGS: more llama-server flags (llamaserver.sh already adds --no-repack where the
# CPU lists AMX: on these VMs llama.cpp's AMX repacking dies of an illegal instruction).
# Files are read from $BENCH_MODELS (default ~/.cache/hotprefix-bench) and made there first
# when missing. For each file and server, into docs/bench/real/TAG-SERVER-*.json: start to
# /health (hotprefix twice: its first start regroups the weights into its cache, the second
# maps them), idle and peak RSS of the process group, its CPU seconds in each workload
# (TAG-SERVER-WORKLOAD-cpu.json, with the load average at its end), the ttft workload (a cold 1,030-token
# prompt, then 5 warm ones on its 1,000-token prefix), decode (one stream at a time, 128
# tokens) and shared (8 concurrent requests on a warm 1,000-token prefix); the machine's
# read bandwidth over as many bytes as a decode step of the file reads (read_bandwidth.py),
# and decode's share of it with the two measured alternately in process (decode_bandwidth.py);
# for the 1B, Gemma 3 and a3b files, int8 mode's KL against float32 mode beside llama-server's (kl_vs_llamacpp.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-docs/bench/real}  # another folder keeps an earlier run's meta.json
PORT=${PORT:-8790}
PEERS=${PEERS:-benchmarks/peers}
BENCH_MODELS=${BENCH_MODELS:-$HOME/.cache/hotprefix-bench}
LLAMASERVER_ARGS=${LLAMASERVER_ARGS:-}
mkdir -p "$OUT"
. benchmarks/rss.sh
TAGS=("$@"); [ ${#TAGS[@]} -gt 0 ] || TAGS=(1b-Q4_K_M 1b-Q4_0 8b-Q4_K_M)
$PY benchmarks/run_facts.py "benchmarks/real_shapes.sh ${TAGS[*]}" > "$OUT/meta.json"

# shellcheck source=benchmarks/peers/lib.sh
. benchmarks/peers/lib.sh  # start_server, wait_up, stop_server; no server outlives the script
start() { start_server "$PORT" "$@"; }  # start LOG COMMAND...: sets $pid

# run TAG SERVER START_COMMAND...: start, measure, run the workloads, stop
run() {
  local tag=$1 server=$2; shift 2
  local url="http://127.0.0.1:$PORT" t0 t1
  t0=$(date +%s.%N)
  start "$OUT/$tag-$server-serve.log" "$@"
  wait_up $pid "$url/v1/models" || { echo "$server did not start on $tag" >&2; return 1; }
  t1=$(date +%s.%N)
  echo "{\"server_start_s\": $(echo "$t1 - $t0" | bc)}" > "$OUT/$tag-$server-start.json"
  rss_start $pid "$OUT/$tag-$server-rss"
  for w in "${WORKLOADS[@]}"; do
    c0=$(cpu_group $pid)
    .venv/bin/hotprefix bench "$url" --workload "$w" --json "$OUT/$tag-$server-$w.json" > /dev/null
    echo "{\"server_cpu_s\": $(echo "$(cpu_group $pid) - $c0" | bc), \"loadavg\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}" \
      > "$OUT/$tag-$server-$w-cpu.json"
  done
  rss_stop $pid "$OUT/$tag-$server-rss"
  # int8 mode's next-token distributions against float32 mode's, beside llama.cpp's own (1B)
  if [ "$server" = llamaserver ] && [ "${tag%%-*}" != 8b ]; then
    $PY benchmarks/kl_vs_llamacpp.py "$url" --model "$file" --json "$OUT/$tag-kl.json" > "$OUT/$tag-kl.log" 2>&1 ||
      echo "kl_vs_llamacpp.py failed on $tag: see $OUT/$tag-kl.log" >&2
  fi
  stop_server $pid
}

for tag in "${TAGS[@]}"; do
  shape=${tag%-*} qtype=${tag##*-}  # the type is the last part (Q4_K_M), the shape the rest (gemma3-270m)
  file=$BENCH_MODELS/random-$shape-$qtype.gguf
  [ -f "$file" ] || $PY benchmarks/make_gguf.py "$shape" --out "$BENCH_MODELS" --types "$qtype"
  $PY benchmarks/read_bandwidth.py "$file" --json "$OUT/$tag-bandwidth.json" > /dev/null
  $PY benchmarks/decode_bandwidth.py "$file" --json "$OUT/$tag-decode-share.json" > /dev/null
  # KV pools of similar capacity: hotprefix's is float32 (2x llama.cpp's f16 a token)
  # at 8B, shared (8 cold 1,030-token prefills for llama-server: ~1,000 s) is left out
  if [ "$shape" = 8b ]; then kv=(--kv-cache-memory 2GiB); ctx=(-c 8192); WORKLOADS=(ttft decode)
  elif [ "$shape" = a3b ]; then kv=(--kv-cache-memory 2GiB); ctx=(-c 16384); WORKLOADS=(ttft decode shared)
  else kv=(); ctx=(-c 16384); WORKLOADS=(ttft decode shared); fi
  # hotprefix: a first start (regroups into the cache when it is cold), then the measured one
  t0=$(date +%s.%N)
  start "$OUT/$tag-hotprefix-first.log" .venv/bin/hotprefix serve --model "$file" --port "$PORT" "${kv[@]}"
  wait_up $pid "http://127.0.0.1:$PORT/health"
  echo "{\"first_start_s\": $(echo "$(date +%s.%N) - $t0" | bc)}" > "$OUT/$tag-hotprefix-first.json"
  stop_server $pid
  run "$tag" hotprefix .venv/bin/hotprefix serve --model "$file" --port "$PORT" "${kv[@]}"
  # shellcheck disable=SC2086  # LLAMASERVER_ARGS: a list of flags
  run "$tag" llamaserver bash "$PEERS/llamaserver.sh" serve "$PORT" -m "$file" "${ctx[@]}" $LLAMASERVER_ARGS
done
$PY benchmarks/real_shapes_table.py "$OUT"
