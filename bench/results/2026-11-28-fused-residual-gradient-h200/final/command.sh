#!/usr/bin/env bash
# The fused residual gradient, final version (one H200): the RMSNorm backward kernel loads the
# residual's gradient with the row, before the block-wide sum (in first-version/ it was
# loaded after it, in the store loop, and the kernel took twice as long).
#  1. fused_layers_test, the executor's GPU equivalence;
#  2. dta-bench on tau2 at scale 0.25, qwen3-1.7b, dta-pack, DTA_FUSED_RESIDUAL=0 and 1 in turn,
#     twice;
#  3. a GPU-only profile of one dta-pack step with the fused residual (first-version/ has the one without).
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
DTA_FUSED_RESIDUAL=1 timeout 90 python3 bench/hf_baseline.py --rollouts=/tmp/tau2.jsonl \
  --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=1 --methods=dta-pack \
  --profile --no-profile_host --profile_top=30 >"$out/all/profile_fused1.txt" 2>&1
echo "profile fused=1 exit $? at $((SECONDS - start)) s"
grep -a "profile of\|CUDAFunctor_add\|RmsNormBackward" "$out/all/profile_fused1.txt" | cut -c1-150
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
