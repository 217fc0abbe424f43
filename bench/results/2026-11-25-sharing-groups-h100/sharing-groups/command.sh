#!/usr/bin/env bash
# One H100: one build of main with SharingGroups (a short prompt before long
# answers recomputed, not shared), then
#  1. gpu_equivalence_test (every method on the GPU against float64 dense);
#  2. the A/B in one process on four AIME-like 16K rollouts (ab_unshare.py: default vs 0);
#  3. dta-bench: dense and dta on those four and on all 16 (C = 1.006), tau2 at scale 0.25
#     (C = 8.35) and GSM8K-like at scale 0.3 (C = 1.10), where nothing should be cut.
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
timeout 150 build-device/tests/gpu_equivalence_test >"$out/gpu_equivalence_test.log" 2>&1
echo "gpu_equivalence_test exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/gpu_equivalence_test.log" | tr '\n' ' ')"
grep -a -E "Failure" -A3 "$out/gpu_equivalence_test.log" | head -12
PYTHONPATH="$site" timeout 100 python3 bench/results/2026-11-25-sharing-groups-h100/ab_unshare.py device-inputs/aime-4.jsonl 3 \
  2>&1 | grep -v -i warn | tee "$out/ab-aime-4.txt"
echo "ab done at $((SECONDS - start)) s"
bench() {  # NAME ROLLOUTS LIMIT FLAGS...
  local name=$1 rollouts=$2 limit=$3
  shift 3
  timeout "$limit" build-device/bin/dta-bench --rollouts="$rollouts" --config=qwen3-1.7b --dtype=bfloat16 \
    --check=false --out_dir="$out/$name" "$@" >"$out/$name.log" 2>&1
  echo "$name exit $? at $((SECONDS - start)) s"
  grep -a "^| dta\|^| dense" "$out/$name/results.md" | cut -d'|' -f1-4,7,9
  grep -a -o '"method": *"[^"]*"\|"forwarded_tokens": *[0-9]*' "$out/$name/results.json" | paste - - | tr -s ' '
}
bench aime-4 device-inputs/aime-s0.1.jsonl 60 --repeats=2 --max_rollouts=4 --methods=dense,dta-bauto-gauto-pack
bench tau2-s0.25 device-inputs/tau2-s0.25.jsonl 60 --repeats=2 --methods=dta-bauto-gauto-pack
bench gsm8k-s0.3 device-inputs/gsm8k-s0.3.jsonl 60 --repeats=2 --methods=dense,dta-bauto-gauto-pack
bench aime-16 device-inputs/aime-s0.1.jsonl 110 --repeats=1 --methods=dense,dta-bauto-gauto-pack
echo "done at $((SECONDS - start)) s"
