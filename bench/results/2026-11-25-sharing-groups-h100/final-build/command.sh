#!/usr/bin/env bash
# One H100: the final build with sharing groups and the fused log-probability head, side by side:
#  1. transformers (SDPA, one rollout at a time), dta's dense and dta (pack=True) through the Python
#     API on tau2 at scale 0.25 (C = 8.35);
#  2. dta-bench on GSM8K-like (scale 0.3) and AIME-like (4 rollouts of 16K) batches: dense and dta;
#  3. the SharingGroups A/B on the AIME-like batch (ab_unshare.py: the default against sharing).
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
PYTHONPATH="$site" timeout 170 python3 bench/hf_baseline.py --rollouts=device-inputs/tau2-s0.25.jsonl \
  --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=1 --methods=hf-sdpa,dta-dense,dta-pack \
  >"$out/hf-s0.25.txt" 2>"$out/hf-s0.25.err"
echo "hf exit $? at $((SECONDS - start)) s"; grep -a "^hf_baseline" "$out/hf-s0.25.err"; grep -a -v '^{' "$out/hf-s0.25.txt"
bench() {  # NAME ROLLOUTS LIMIT FLAGS...
  local name=$1 rollouts=$2 limit=$3
  shift 3
  timeout "$limit" build-device/bin/dta-bench --rollouts="$rollouts" --config=qwen3-1.7b --dtype=bfloat16 \
    --check=false --out_dir="$out/$name" "$@" >"$out/$name.log" 2>&1
  echo "$name exit $? at $((SECONDS - start)) s"
  grep -a "^| dta\|^| dense" "$out/$name/results.md" | cut -d'|' -f1-4,7,9
}
bench gsm8k-s0.3 device-inputs/gsm8k-s0.3.jsonl 70 --repeats=2 --methods=dense,dta-bauto-gauto-pack
bench aime-4 device-inputs/aime-s0.1.jsonl 60 --repeats=2 --max_rollouts=4 --methods=dense,dta-bauto-gauto-pack
PYTHONPATH="$site" timeout 90 python3 bench/results/2026-11-25-sharing-groups-h100/ab_unshare.py device-inputs/aime-4.jsonl 2 \
  2>&1 | grep -v -i warn | tee "$out/ab-aime-4.txt"
echo "done at $((SECONDS - start)) s"
