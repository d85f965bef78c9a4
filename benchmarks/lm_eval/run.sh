#!/usr/bin/env bash
# lm-evaluation-harness's `local-completions` model against `hotprefix serve` on the default
# model, on a local multiple-choice task (tiny_mc.yaml: no hub download). Its loglikelihood
# requests are completions with `echo`, `logprobs: 1` and `max_tokens: 1`, read back from the
# prompt's logprobs: the client path that issue 28 names. Not part of the tests (it installs
# lm-eval, ~1.6 GB, into its own venv).
#
#   bash benchmarks/lm_eval/run.sh [PORT]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
port="${1:-8199}"
venv="${LMEVAL_VENV:-$HOME/.cache/hotprefix-lmeval}"
py="$repo/.venv/bin/python"
if [ ! -x "$venv/bin/lm_eval" ]; then
  python3 -m venv "$venv"
  transformers="$("$py" -c 'import transformers; print(transformers.__version__)')"
  "$venv/bin/pip" install --quiet "torch==2.13.0" "lm-eval[api]" "transformers==$transformers"
fi
tokenizer="$("$py" -c 'from hotprefix.model.loader import default_model_path, gguf_tokenizer, _tokenizer_cache_dir
p = default_model_path(); gguf_tokenizer(p); print(_tokenizer_cache_dir(p))')"
"$repo/.venv/bin/hotprefix" serve --port "$port" --served-model-name smollm2 >"${TMPDIR:-/tmp}/lm_eval_serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.25
done
cd "$here"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$venv/bin/lm_eval" --model local-completions \
  --model_args "model=smollm2,base_url=http://127.0.0.1:$port/v1/completions,tokenizer_backend=huggingface,tokenizer=$tokenizer,num_concurrent=1,max_retries=1" \
  --tasks hotprefix_tiny_mc --include_path "$here"
