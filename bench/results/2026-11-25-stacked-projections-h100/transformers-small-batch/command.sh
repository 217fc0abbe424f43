#!/usr/bin/env bash
# One H100: transformers (per rollout with SDPA; packed with SDPA and flex) beside dta's dense and
# dta on the small tau2 batch, and dta alone on the scale-0.25 batch (C = 8.35), dta profiled
# (launches, GPU busy, host operations). Logs under $OUT; each method reports as it finishes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
start=$SECONDS
site="$(scripts/device_python.sh)" || exit 1
echo "built at $((SECONDS - start)) s"
run() {  # NAME ROLLOUTS TIMEOUT FLAGS...
  local name=$1 rollouts=$2 limit=$3
  shift 3
  PYTHONPATH="$site" timeout "$limit" python3 bench/hf_baseline.py --rollouts="$rollouts" \
    --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json "$@" >"$out/$name.txt" 2>"$out/$name.err"
  echo "$name exit $? at $((SECONDS - start)) s"
  grep -a "^hf_baseline" "$out/$name.err"
  grep -a -v '^{' "$out/$name.txt" | head -40
}
# transformers first: dta's trainer keeps its caches (the path stack, graphs) between steps.
run hf-s0.002 device-inputs/tau2-s0.002.jsonl 300 --profile=dta --methods=hf-sdpa,hf-sdpa-packed,dta-dense,dta
