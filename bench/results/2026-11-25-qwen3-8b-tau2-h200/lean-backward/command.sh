#!/usr/bin/env bash
# One H200: Qwen3-8B on tau2 at scale 0.2 (C = 7.92) with the leaner Hopper backward (commit
# 773a848): dense-ckpt and dta (MFU), as ../fused-head/ measured before it.
set -uo pipefail
source scripts/device_session.sh
timeout 280 build-device/bin/dta-bench --rollouts=device-inputs/tau2-s0.2.jsonl --config=qwen3-8b --dtype=bfloat16 \
  --check=false --out_dir="$out/8b" --repeats=1 --methods=dense-ckpt,dta-bauto-gauto-pack >"$out/8b.log" 2>&1
echo "8b exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/8b/results.md" | head -6
cp "$out/8b/results.md" "$out/8b.results.md"; rm -rf "$out/8b"
timeout 60 build-device/bin/dta-attention-bench >"$out/attention_bench.log" 2>&1
grep -a "^|" "$out/attention_bench.log" | grep -a "8192 Hq=16\|16384\|Hq=32" 
echo "done at $((SECONDS - start)) s"
