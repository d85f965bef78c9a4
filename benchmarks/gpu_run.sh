#!/usr/bin/env bash
# Issue 48's one command on a lent GPU: the GPU tests compiled, then benchmarks/gpu_path.py
# end to end, every figure a JSON line under $OUT. docs/benchmarks.md ("The GPU path") says
# how the device tool runs it.
#
#   bash benchmarks/gpu_run.sh prepare     # here, first: the tokenizer and the tp-ab base, into .device/
#   bash benchmarks/gpu_run.sh             # there: tp-ab, tests, 8b, then 1b and 8b-fp8 while time is left
#   bash benchmarks/gpu_run.sh 8b-fp8 1b   # there: these phases only (a rerun of what was left)
#
# Phases, in order, each with its own time limit (cut to what the budget has left; a
# phase that would get under 60 s is recorded as skipped):
#   tp-ab   issue 47: gpu_tp_ab.py, -tp 1 at this tree against the code before tensor
#           parallelism (.device/base, commit c9b842d), alternating, 8B and 1B shapes    240 s
#   tests   tests/model/test_gpu.py and test_triton_attention.py, compiled      150 s
#           (test_gpu_path.py is the CPU's proof, by Triton's interpreter: not run there)
#   8b      gpu_path.py on Llama-3.1-8B's shape, bf16, everything              270 s
#   8b-fp8  the same with --kv-cache-dtype fp8 (no transformers peer)           150 s
#   1b      gpu_path.py on Llama-3.2-1B's shape, bf16, everything              120 s
# (the default order: tp-ab tests 8b 1b 8b-fp8)
# BUDGET_S (default 470) bounds the whole run: it ends within 8 minutes. Nothing is
# installed: python3 there holds torch, triton, transformers and pytest; hotprefix runs
# from this tree (PYTHONPATH). Written under $OUT (default ./gpu-out): figures.jsonl
# (every figure, one JSON line each), phases.jsonl (each phase's exit status, seconds,
# pytest's summary), tests.log, bench.log.
set -u
cd "$(dirname "$0")/.."
TOKENIZER=.device/tokenizer
TP_BASE=c9b842d

if [ "${1:-}" = prepare ]; then  # the bundled model's tokenizer as a folder (3.5 MB; the GGUF is 98 MB)
    src=$(.venv/bin/python -c "from hotprefix.model.default_model import default_model_path
from hotprefix.model.loader import gguf_tokenizer
print(gguf_tokenizer(default_model_path()).name_or_path)" | tail -1) || exit 1
    rm -rf "$TOKENIZER" && mkdir -p .device && cp -r "$src" "$TOKENIZER" && ls -l "$TOKENIZER"
    # tp-ab's base: the package as it was before tensor parallelism merged (174aa08^1)
    rm -rf .device/base && mkdir -p .device/base && git archive "$TP_BASE" hotprefix | tar -x -C .device/base || exit 1
    echo "commit: $(git rev-parse --short HEAD)   carry: [\".device\"]"
    exit
fi

OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-470} ))
PHASES=${*:-tp-ab tests 8b 1b 8b-fp8}
[ -d "$TOKENIZER" ] || echo "no $TOKENIZER: run 'bash benchmarks/gpu_run.sh prepare' here and carry .device" >&2
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")  # Triton compiles the tests' kernels in 4 processes
BENCH=("$PY" benchmarks/gpu_path.py --tokenizer "$TOKENIZER" --out "$OUT/figures.jsonl")

record() {  # phase, rc, seconds, limit, extra JSON fields
    echo "{\"what\": \"phase\", \"phase\": \"$1\", \"rc\": $2, \"seconds\": $3, \"limit_s\": $4$5}" \
        | tee -a "$OUT/phases.jsonl"
}

phase() {  # name, limit in seconds, log file, command...
    local name=$1 limit=$2 log=$3 left t0 rc
    shift 3
    left=$(( DEADLINE - $(date +%s) ))
    if (( left < 60 )); then
        record "$name" null 0 0 ", \"skipped\": \"$left s left of BUDGET_S\""
        return
    fi
    (( limit > left )) && limit=$left
    echo "== $name (limit ${limit}s): $*" | tee -a "$log"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    local extra=""
    if [ "$name" = tests ]; then  # pytest's last line: "N passed, M failed, ... in Xs"
        extra=", \"pytest\": \"$(grep -E '(passed|failed|error)' "$log" | tail -1 | tr -d '"=')\""
    fi
    record "$name" "$rc" $(( $(date +%s) - t0 )) "$limit" "$extra"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/bench.log" 2>&1
"$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/bench.log" 2>&1
for p in $PHASES; do
    case $p in
        tp-ab)  phase tp-ab 240 "$OUT/bench.log" "$PY" benchmarks/gpu_tp_ab.py --tokenizer "$TOKENIZER" \
                    --checkout "base=.device/base" --checkout new=. --rounds "${TP_AB_ROUNDS:-2}" --child-timeout 150 \
                    --model ${TP_AB_MODELS:-llama-3.1-8b llama-3.2-1b} --reps "${TP_AB_REPS:-3}" \
                    --out "$OUT/figures.jsonl" ;;
        tests)  phase tests 150 "$OUT/tests.log" "$PY" -m pytest -q -rfEs -p no:cacheprovider $XDIST \
                    tests/model/test_gpu.py tests/model/test_triton_attention.py ;;
        8b)     phase 8b 270 "$OUT/bench.log" "${BENCH[@]}" --model llama-3.1-8b ;;
        8b-fp8) phase 8b-fp8 150 "$OUT/bench.log" "${BENCH[@]}" --model llama-3.1-8b --kv-cache-dtype fp8 \
                    --skip-peer ;;
        1b)     phase 1b 120 "$OUT/bench.log" "${BENCH[@]}" --model llama-3.2-1b ;;
        *)      echo "unknown phase $p (tp-ab tests 8b 8b-fp8 1b)" >&2; exit 2 ;;
    esac
done
