#!/usr/bin/env bash
# The stacked gate/up projections' build (commit 8d2ea7c) on one H100, then
#  1. the GPU tests its changes touch (fused layers, Hopper attention, equivalence);
#  2. the stacked gate/up projection A/B in one process (ab.py, tau2 C = 5.89);
#  3. transformers (SDPA, per rollout) beside dta's dense and dta on tau2 at scale 0.25 (C = 8.35);
#  4. dta-bench on the same batch (dense, dense-ckpt, dta: MFU), and GSM8K- and AIME-like batches.
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
for t in fused_layers_test hopper_tree_attention_test gpu_equivalence_test; do
  timeout 150 build-device/tests/$t >"$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -a -E "Failure" -A3 "$out/$t.log" | head -12
done
echo "tests done at $((SECONDS - start)) s"
PYTHONPATH="$site" timeout 100 python3 bench/ab_env.py device-inputs/tau2-s0.002.jsonl \
  separate=DTA_STACKED_PROJECTIONS=0 stacked= 2>&1 | grep -v -i warn | tee "$out/ab.txt"
echo "ab done at $((SECONDS - start)) s"
PYTHONPATH="$site" timeout 150 python3 bench/hf_baseline.py --rollouts=device-inputs/tau2-s0.25.jsonl \
  --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=1 --methods=hf-sdpa,dta-dense,dta \
  >"$out/hf-s0.25.txt" 2>"$out/hf-s0.25.err"
echo "hf exit $? at $((SECONDS - start)) s"; grep -a "^hf_baseline" "$out/hf-s0.25.err"; grep -a -v '^{' "$out/hf-s0.25.txt"
bench() {  # NAME ROLLOUTS LIMIT FLAGS...
  local name=$1 rollouts=$2 limit=$3
  shift 3
  timeout "$limit" build-device/bin/dta-bench --rollouts="$rollouts" --config=qwen3-1.7b --dtype=bfloat16 \
    --check=false --out_dir="$out/$name" "$@" >"$out/$name.log" 2>&1
  echo "$name exit $? at $((SECONDS - start)) s"
  cat "$out/$name/results.md" 2>/dev/null | grep -a "^|" | head -12
}
bench tau2-s0.25 device-inputs/tau2-s0.25.jsonl 110 --repeats=1 --methods=dense,dense-ckpt,dta-bauto-gauto-pack
bench gsm8k-s0.3 device-inputs/gsm8k-s0.3.jsonl 70 --repeats=1 --methods=dense,dta-bauto-gauto-pack
bench aime-4 device-inputs/aime-s0.1.jsonl 60 --repeats=1 --max_rollouts=4 --methods=dense,dta-bauto-gauto-pack
echo "done at $((SECONDS - start)) s"
