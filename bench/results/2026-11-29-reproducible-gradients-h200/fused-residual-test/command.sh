#!/usr/bin/env bash
# One H200: the fused residual gradient against autograd's sum inside the
# executor on the GPU (float32 and bfloat16, the kernels' path; every family, dta and dense):
# gpu_equivalence_test's new FusedResidualGradientIsBitwiseAutogradsSum, and the rest of it.
set -uo pipefail
export DTA_DEVICE_TARGETS="gpu_equivalence_test"
source scripts/device_session.sh
run_gtests gpu_equivalence_test
grep -a "FusedResidual" "$out/all/gpu_equivalence_test.log" | head -12
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
