#!/usr/bin/env bash
# One H100: one build of main with the long-chain split merged, then
#  1. its GPU test (chunk_attention_test);
#  2. the split's A/B in one build: AIME-like (4 rollouts of 16K) and tau2 at scale 0.25 (C = 8.35),
#     the new default against DTA_CUDNN_PREFIX=0 (never split, the old default for these chunks);
#  3. the Python API's step beside dta-bench's on tau2 at scale 0.25: the time inside
#     compute_gradients, the tokens forwarded, and a GPU-only profile (is the step host-bound?).
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
timeout 60 build-device/tests/chunk_attention_test >"$out/chunk_attention_test.log" 2>&1
echo "chunk_attention_test exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/chunk_attention_test.log" | tr '\n' ' ')"
grep -a -E "Failure" -A3 "$out/chunk_attention_test.log" | head -12
bench() {  # NAME ROLLOUTS FLAGS...
  local name=$1 rollouts=$2
  shift 2
  timeout 90 build-device/bin/dta-bench --rollouts="$rollouts" --config=qwen3-1.7b --dtype=bfloat16 \
    --check=false --out_dir="$out/$name" "$@" >"$out/$name.log" 2>&1
  echo "$name exit $? at $((SECONDS - start)) s"
  grep -a "^| dta\|^| dense" "$out/$name/results.md" | cut -d'|' -f1-4,7,9
  grep -a -o '"method": *"[^"]*"\|"forwarded_tokens": *[0-9]*' "$out/$name/results.json" | paste - - | tr -s ' '
}
bench aime-split device-inputs/aime-s0.1.jsonl --repeats=2 --max_rollouts=4 --methods=dense,dta-bauto-gauto-pack
DTA_CUDNN_PREFIX=0 bench aime-tree device-inputs/aime-s0.1.jsonl --repeats=2 --max_rollouts=4 --methods=dta-bauto-gauto-pack
bench tau2-split device-inputs/tau2-s0.25.jsonl --repeats=2 --methods=dta-bauto-gauto-pack
DTA_CUDNN_PREFIX=0 bench tau2-tree device-inputs/tau2-s0.25.jsonl --repeats=2 --methods=dta-bauto-gauto-pack
PYTHONPATH="$site" timeout 150 python3 bench/hf_baseline.py --rollouts=device-inputs/tau2-s0.25.jsonl \
  --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=2 --methods=dta-pack \
  --profile --no-profile_host >"$out/py-s0.25.txt" 2>"$out/py-s0.25.err"
echo "python api exit $? at $((SECONDS - start)) s"; grep -a "^hf_baseline" "$out/py-s0.25.err"; grep -a -v '^{' "$out/py-s0.25.txt"
echo "done at $((SECONDS - start)) s"
