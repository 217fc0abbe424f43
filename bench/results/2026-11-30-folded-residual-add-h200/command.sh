#!/usr/bin/env bash
export DTA_DEVICE_TARGETS="fused_layers_test gpu_equivalence_test dta-bench dta-workload" DTA_DEVICE_BUILD_TIMEOUT=300
source scripts/device_session.sh
run_gtests fused_layers_test
timeout 120 build-device/tests/gpu_equivalence_test \
  --gtest_filter='*FoldedResidualAdd*:*FusedResidualGradient*' > $out/all/gpu_equivalence_fold.log 2>&1
echo "gpu_equivalence (fold) exit $?: $(grep -c '^\[       OK' $out/all/gpu_equivalence_fold.log) ok, $(grep -c '^\[  FAILED' $out/all/gpu_equivalence_fold.log) failed at $((SECONDS - start)) s"
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl > /dev/null 2>&1
for i in 1 2; do
  for v in 0 1; do
    DTA_FUSED_RESIDUAL_ADD=$v timeout 45 build-device/bin/dta-bench --config=qwen3-1.7b --device=cuda \
      --methods=dta-bauto-gauto-pack --check=false --repeats=3 --rollouts=/tmp/tau2.jsonl \
      --out_dir=/tmp/ab$v$i > /dev/null 2>&1
    echo "DTA_FUSED_RESIDUAL_ADD=$v run $i: $(grep '^| dta' /tmp/ab$v$i/results.md | cut -d'|' -f2,3,9)" | tee -a $out/ab.txt
  done
done
echo done at $((SECONDS - start)) s
