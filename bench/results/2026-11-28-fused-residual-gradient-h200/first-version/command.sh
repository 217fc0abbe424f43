#!/usr/bin/env bash
# The fused residual gradient, first version (one H200): the residual stream's gradient summed inside the RMSNorm
# backward kernel (Projections' `residual`) instead of by autograd's add afterwards.
#  1. fused_layers_test (the kernel's add is bitwise autograd's), the executor's GPU equivalence,
#     the Python trainer's GPU tests;
#  2. dta-bench on tau2 at scale 0.25, qwen3-1.7b, dta-pack, DTA_FUSED_RESIDUAL=0 and 1 in turn,
#     twice;
#  3. a GPU-only profile of one dta-pack step each way (launches, GPU time by kind).
set -uo pipefail
export DTA_DEVICE_TARGETS="dta_python dta-workload dta-bench fused_layers_test gpu_equivalence_test"
source scripts/device_session.sh
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
mkdir -p "$out/all"
run_gtests fused_layers_test gpu_equivalence_test
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
for round in 1 2; do
  for fused in 0 1; do
    DTA_FUSED_RESIDUAL=$fused timeout 60 build-device/bin/dta-bench --rollouts=/tmp/tau2.jsonl \
      --config=qwen3-1.7b --dtype=bfloat16 --check=false --out_dir=/tmp/t$fused$round --repeats=2 \
      --methods=dta-bauto-gauto-pack >"$out/all/tau2_fused${fused}_$round.log" 2>&1
    echo "round $round fused=$fused exit $? at $((SECONDS - start)) s: $(grep -a '^| dta' /tmp/t$fused$round/results.md | cut -d'|' -f2,3,9)"
    cp /tmp/t$fused$round/results.md "$out/all/tau2_fused${fused}_$round.results.md"
  done
done
for fused in 1 0; do
  DTA_FUSED_RESIDUAL=$fused timeout 90 python3 bench/hf_baseline.py --rollouts=/tmp/tau2.jsonl \
    --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=1 --methods=dta-pack \
    --profile --no-profile_host --profile_top=30 >"$out/all/profile_fused$fused.txt" 2>&1
  echo "profile fused=$fused exit $? at $((SECONDS - start)) s"
  grep -a "profile of\|CUDAFunctor_add\|RmsNormBackward" "$out/all/profile_fused$fused.txt" | cut -c1-150
done
if ((SECONDS - start < 400)); then
  PYTHONPATH="$site:$PWD/tests/python" timeout $((490 - (SECONDS - start))) python3 -m pytest -q -s \
    tests/python/test_trainer_gpu.py >"$out/all/pytest.log" 2>&1
  echo "pytest exit $? at $((SECONDS - start)) s"; grep -a "bf16 median\|passed\|failed\|Error" "$out/all/pytest.log" | head -8
fi
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
