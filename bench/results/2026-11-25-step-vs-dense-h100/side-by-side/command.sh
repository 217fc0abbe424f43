#!/usr/bin/env bash
# One H100: the build of commit 773a848 (the leaner Hopper backward), side by side in one call:
#  1. transformers (SDPA, one rollout at a time), dta's dense and dta (pack=True) through the Python
#     API on tau2 at scale 0.25 (C = 8.35);
#  2. dta-bench on tau2 at scale 0.25: dense, dense-ckpt, dta (the benchmark table);
#  3. dta-bench on GSM8K-like (scale 0.3) and AIME-like (4 rollouts of 16K) batches: dense and dta.
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
  grep -a "^|" "$out/$name/results.md" | head -6
  cp "$out/$name/results.md" "$out/$name.results.md"
}
bench tau2-s0.25 device-inputs/tau2-s0.25.jsonl 150 --repeats=2 --methods=dense,dense-ckpt,dta-bauto-gauto-pack
bench gsm8k-s0.3 device-inputs/gsm8k-s0.3.jsonl 70 --repeats=2 --methods=dense,dta-bauto-gauto-pack
bench aime-4 device-inputs/aime-4.jsonl 60 --repeats=2 --methods=dense,dta-bauto-gauto-pack
rm -rf "$out"/tau2-s0.25 "$out"/gsm8k-s0.3 "$out"/aime-4
echo "done at $((SECONDS - start)) s"
