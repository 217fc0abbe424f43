#!/usr/bin/env bash
# The fourth call: the Hopper backward (helper-13's kernels) on the device: its tests, the
# attention bench, the equivalence suites, and dta's step with it on and off in one process.
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
for t in hopper_tree_attention_test tree_attention_test chunk_attention_test gpu_equivalence_test; do
  timeout 200 build-device/tests/$t >"$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -a -E "Failure" -A3 "$out/$t.log" | head -12
done
timeout 60 build-device/bin/dta-attention-bench >"$out/attention_bench.log" 2>&1; grep -a "^|" "$out/attention_bench.log"
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.002 --out="$out/tau2-s0.002.jsonl" 2>/dev/null
PYTHONPATH="$site" timeout 150 python3 bench/ab_env.py "$out/tau2-s0.002.jsonl" \
  fa2=DTA_HOPPER_ATTENTION=0,DTA_HOPPER_ATTENTION_BACKWARD=0 hopper-fwd=DTA_HOPPER_ATTENTION_BACKWARD=0 \
  hopper= 2>&1 | grep -v Warn | tee "$out/ab.txt"
echo "done at $((SECONDS - start)) s"
