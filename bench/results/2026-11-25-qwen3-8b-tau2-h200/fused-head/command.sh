#!/usr/bin/env bash
# One H200: Qwen3-8B on tau2 at scale 0.2 (C = 7.92) with the fused log-probability head: dense-ckpt
# and dta (MFU), as ../before-fused-head/ measured before it.
set -uo pipefail
source scripts/device_session.sh
timeout 280 build-device/bin/dta-bench --rollouts=device-inputs/tau2-s0.2.jsonl --config=qwen3-8b --dtype=bfloat16 \
  --check=false --out_dir="$out/8b" --repeats=1 --methods=dense-ckpt,dta-bauto-gauto-pack >"$out/8b.log" 2>&1
echo "8b exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/8b/results.md" | head -6
