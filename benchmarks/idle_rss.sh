#!/usr/bin/env bash
# Idle RSS of hotprefix and llama-server on the same GGUF, in one run: each server started
# alone, its process group's resident set (benchmarks/rss.sh's rss_group) read 2 s after
# /v1/models answers, then stopped; the two alternate for ROUNDS rounds.
#
#   bash benchmarks/idle_rss.sh FILE.gguf [ROUNDS]     ($LLAMASERVER_ARGS: more llama-server flags)
set -euo pipefail
cd "$(dirname "$0")/.."
FILE=$1 ROUNDS=${2:-2} PORT=${PORT:-8795}
LLAMASERVER_ARGS=${LLAMASERVER_ARGS:---no-repack}
. benchmarks/rss.sh
# shellcheck source=benchmarks/peers/lib.sh
. benchmarks/peers/lib.sh
idle() {  # idle NAME COMMAND...: start, wait, print the idle RSS in MiB, stop
  local name=$1; shift
  start_server "$PORT" "/tmp/idle_rss-$name.log" "$@"
  wait_up "$pid" "http://127.0.0.1:$PORT/v1/models"
  sleep 2
  echo "$name $(( $(rss_group "$pid") / 1048576 )) MiB"
  stop_server "$pid"
}
for round in $(seq 1 "$ROUNDS"); do
  echo "round $round"
  idle hotprefix .venv/bin/hotprefix serve --model "$FILE" --port "$PORT"
  # shellcheck disable=SC2086  # LLAMASERVER_ARGS: a list of flags
  idle llamaserver bash benchmarks/peers/llamaserver.sh serve "$PORT" -m "$FILE" -c 16384 $LLAMASERVER_ARGS
done
