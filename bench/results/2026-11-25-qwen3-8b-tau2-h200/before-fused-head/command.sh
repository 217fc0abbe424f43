#!/usr/bin/env bash
# One H200: one build of main, then
#  1. Qwen3-8B on tau2 at scale 0.2 (C = 7.92, the batch of the 8B table): dense-ckpt and dta (MFU);
#  2. where the 1.7B step's GPU time goes on tau2 at scale 0.25 (a GPU-only profile, 60 kernels);
#  3. dense against dta on four AIME-like 16K rollouts, both profiled (what makes dta slower there).
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
timeout 260 build-device/bin/dta-bench --rollouts=device-inputs/tau2-s0.2.jsonl --config=qwen3-8b --dtype=bfloat16 \
  --check=false --out_dir="$out/8b" --repeats=1 --methods=dense-ckpt,dta-bauto-gauto-pack >"$out/8b.log" 2>&1
echo "8b exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/8b/results.md" | head -6
profile() {  # NAME ROLLOUTS METHODS HOST TOP
  PYTHONPATH="$site" timeout 120 python3 bench/hf_baseline.py --rollouts="$2" --config=qwen3-1.7b --device=cuda \
    --dtype=bfloat16 --json --repeats=2 --methods="$3" --profile "$4" --profile_top="$5" \
    >"$out/$1.txt" 2>"$out/$1.err"
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a "^hf_baseline" "$out/$1.err"; grep -a -v '^{' "$out/$1.txt"
}
profile tau2-s0.25 device-inputs/tau2-s0.25.jsonl dta-pack --no-profile_host 60
profile aime-4 device-inputs/aime-4.jsonl dta-dense,dta-pack --profile_host 30
echo "done at $((SECONDS - start)) s"
