#!/usr/bin/env bash
# NVIDIA's aiperf (a load generator none of us wrote) on the headline workload: chat
# completions, streamed, every request behind the same 1,000-token system prompt with its own
# 30-token question, 32 output tokens (ignore_eos), greedy; at a given concurrency.
#
#   aiperf.sh install                      make $PEERS_HOME/aiperf (a venv with aiperf 0.13.0)
#   aiperf.sh profile URL LABEL CONC [ARGS] run it against URL (e.g. http://127.0.0.1:8000) at
#                                          concurrency CONC; results in $OUT/LABEL-cCONC (OUT
#                                          default docs/bench/aiperf); ARGS go to aiperf (e.g.
#                                          --api-key KEY for a gateway)
#   aiperf.sh installed                    exit 0 when install has been done
#   aiperf.sh plan [install|profile ...]   print the steps without running them
#
# REQUESTS (default 4 x CONC, at least 16) are measured after WARMUP (default 2) unmeasured
# ones that make the shared prompt warm. Tokens are counted with the default model's own
# tokenizer. PEERS_HOME defaults to ~/.cache/hotprefix-peers.
set -euo pipefail
# shellcheck source=benchmarks/peers/lib.sh
. "$(dirname "$0")/lib.sh"
VERSION=0.13.0
V=$PEERS_HOME/aiperf

installed() { [ -x "$V/bin/aiperf" ] && [ "$("$V/bin/aiperf" --version 2>/dev/null | tail -1)" = "$VERSION" ]; }

install() {
  if installed; then note "aiperf $VERSION already in $V"; return; fi
  step python3 -m venv "$V"
  step "$V/bin/pip" install -q "aiperf==$VERSION"
}

profile() {
  [ $# -ge 3 ] || usage 2
  local url=$1 label=$2 conc=$3 tok
  shift 3
  local requests=${REQUESTS:-$((conc * 4 > 16 ? conc * 4 : 16))}
  tok=$(tokenizer_dir)
  step "$V/bin/aiperf" profile --model smollm2 --url "$url" --endpoint-type chat --streaming \
    --tokenizer "$tok" --shared-system-prompt-length 1000 --prompt-input-tokens-mean 30 \
    --prompt-input-tokens-stddev 0 --prompt-output-tokens-mean 32 --prompt-output-tokens-stddev 0 \
    --extra-inputs ignore_eos:true --extra-inputs temperature:0 --concurrency "$conc" \
    --request-count "$requests" --warmup-request-count "${WARMUP:-2}" --random-seed 0 --ui-type none \
    --output-artifact-dir "${OUT:-docs/bench/aiperf}/$label-c$conc" "$@"
}

dispatch "$@"
