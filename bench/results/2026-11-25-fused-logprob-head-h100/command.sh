#!/usr/bin/env bash
# One H100: one build of main with the fused log-probability head
# (kernels/fused_layers.h: row statistics and the logits' gradient in one pass each), then
#  1. fused_layers_test (LogitHeadMatchesTheCpu) and gpu_equivalence_test;
#  2. dta on tau2 at scale 0.25 (C = 8.35) through the Python API with a GPU-only profile (the
#     profile in ../2026-11-25-sharing-groups-h100/long-chain-split/ is the before);
#  3. the side-by-side table of the final build: dense, dense-ckpt, dta on tau2 0.25.
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
for t in fused_layers_test gpu_equivalence_test; do
  timeout 150 build-device/tests/$t >"$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -a -E "Failure" -A3 "$out/$t.log" | head -12
done
profile() {  # NAME ROLLOUTS FLAGS...
  local name=$1 rollouts=$2
  shift 2
  PYTHONPATH="$site" timeout 120 python3 bench/hf_baseline.py --rollouts="$rollouts" --config=qwen3-1.7b \
    --device=cuda --dtype=bfloat16 --json --repeats=3 --methods=dta-pack "$@" >"$out/$name.txt" 2>"$out/$name.err"
  echo "$name exit $? at $((SECONDS - start)) s"; grep -a "^hf_baseline" "$out/$name.err"; grep -a -v '^{' "$out/$name.txt"
}
profile head-fused device-inputs/tau2-s0.25.jsonl --profile --no-profile_host --profile_top=60
timeout 150 build-device/bin/dta-bench --rollouts=device-inputs/tau2-s0.25.jsonl --config=qwen3-1.7b --dtype=bfloat16 \
  --check=false --out_dir="$out/tau2-s0.25" --repeats=1 --methods=dense,dense-ckpt,dta-bauto-gauto-pack \
  >"$out/tau2-s0.25.log" 2>&1
echo "tau2-s0.25 exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/tau2-s0.25/results.md" | head -6
echo "done at $((SECONDS - start)) s"
