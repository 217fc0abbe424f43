#!/usr/bin/env bash
# One H100: one build with the leaner Hopper backward (row statistics in
# shared memory, the dK/dV element loop split into masked and unmasked copies, P computed while
# dP runs, no GEMM in flight across the loops' back edges), then
#  1. the GPU exactness tests (the Hopper test prints, per case, which gradients came out in the
#     FlashAttention-2 kernels' bits);
#  2. dta-attention-bench (backward TFLOP/s against PyTorch's flash in the same run);
#  3. dta's step on tau2 at scale 0.25 with a GPU-only profile (../2026-11-25-fused-logprob-head-h100/ is the before:
#     dK/dV 365 ms, dQ 156 ms), and dta-bench's table.
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
for t in hopper_tree_attention_test tree_attention_test gpu_equivalence_test; do
  timeout 200 build-device/tests/$t >"$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -a -E "Failure" -A3 "$out/$t.log" | head -12
done
grep -a "bits vs fa2" "$out/hopper_tree_attention_test.log" | sed -E 's/^(.{40}).*(bits vs fa2.*)$/\1 \2/' | head -40
timeout 90 build-device/bin/dta-attention-bench >"$out/attention_bench.log" 2>&1
grep -a "^|" "$out/attention_bench.log"
PYTHONPATH="$site" timeout 150 python3 bench/hf_baseline.py --rollouts=device-inputs/tau2-s0.25.jsonl \
  --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=3 --methods=dta-pack \
  --profile --no-profile_host --profile_top=40 >"$out/profile.txt" 2>"$out/profile.err"
echo "profile exit $? at $((SECONDS - start)) s"; grep -a "^hf_baseline" "$out/profile.err"
grep -a -v '^{' "$out/profile.txt" | grep -a -i "dkdv\|dqkernel\|attention\|gemm\|busy\|step\|other" | head -30
timeout 150 build-device/bin/dta-bench --rollouts=device-inputs/tau2-s0.25.jsonl --config=qwen3-1.7b \
  --dtype=bfloat16 --check=false --out_dir="$out/tau2-s0.25" --repeats=2 \
  --methods=dense,dense-ckpt,dta-bauto-gauto-pack >"$out/tau2-s0.25.log" 2>&1
echo "tau2-s0.25 exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/tau2-s0.25/results.md" | head -6
echo "done at $((SECONDS - start)) s"
