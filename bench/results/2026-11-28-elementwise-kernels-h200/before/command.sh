#!/usr/bin/env bash
# One H200: the build before the elementwise kernels (commit 2b7d902)
#  1. the bf16 defect: test_trainer_gpu's bf16 check, then each method's bf16 error against float64
#     under each kernel switch (../test_diag_bf16.py), to find the CUDA path that adds it;
#  2. dta's step on tau2 at scale 0.25 (C = 8.35, Qwen3-1.7B): dta-bench's dense, dense-ckpt and dta
#     (the H200's before), and a GPU-only profile of dta-pack.
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
cp bench/results/2026-11-28-elementwise-kernels-h200/test_diag_bf16.py tests/python/
timeout 120 env PYTHONPATH="$site:$PWD/tests/python" python3 -m pytest -q -x \
  tests/python/test_trainer_gpu.py >"$out/test_trainer_gpu.log" 2>&1
echo "test_trainer_gpu exit $?"; grep -a "passed\|failed\|Error" "$out/test_trainer_gpu.log" | head -5
for setting in default DTA_FUSED_LAYERS=0 DTA_BATCHED_COPY=0 DTA_CUDNN_ATTENTION=0 DTA_STACKED_PROJECTIONS=0 DIAG_NO_REDUCED_PRECISION=1; do
  envs=(DIAG_LABEL="$setting"); [[ $setting == default ]] || envs+=("$setting")
  timeout 90 env "${envs[@]}" PYTHONPATH="$site:$PWD/tests/python" python3 -m pytest -q -s \
    tests/python/test_diag_bf16.py >>"$out/diag.log" 2>&1
done
grep -a "^DIAG" "$out/diag.log"
echo "diag done at $((SECONDS - start)) s"
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2-s0.25.jsonl 2>/dev/null
timeout 150 build-device/bin/dta-bench --rollouts=/tmp/tau2-s0.25.jsonl --config=qwen3-1.7b \
  --dtype=bfloat16 --check=false --out_dir="$out/tau2" --repeats=2 \
  --methods=dense,dense-ckpt,dta-bauto-gauto-pack >"$out/tau2-s0.25.log" 2>&1
echo "tau2-s0.25 exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/tau2/results.md" | head -6; cp "$out/tau2/results.md" "$out/tau2-results.md"; rm -rf "$out/tau2"
PYTHONPATH="$site" timeout 120 python3 bench/hf_baseline.py --rollouts=/tmp/tau2-s0.25.jsonl \
  --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=2 --methods=dta-pack \
  --profile --no-profile_host --profile_top=50 >"$out/profile.txt" 2>"$out/profile.err"
echo "profile exit $? at $((SECONDS - start)) s"
grep -a -v '^{' "$out/profile.txt" | head -64
echo "done at $((SECONDS - start)) s"
