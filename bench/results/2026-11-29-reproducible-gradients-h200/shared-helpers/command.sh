#!/usr/bin/env bash
# One H200: gpu_equivalence_test after its two bitwise checks were
# folded onto shared helpers (FixedPlanMethods, ExpectBitwiseEqual; the fused-residual check now
# runs the packed method too).
set -uo pipefail
export DTA_DEVICE_TARGETS="gpu_equivalence_test"
source scripts/device_session.sh
run_gtests gpu_equivalence_test
grep -a "Reproducible\|FusedResidual" "$out/all/gpu_equivalence_test.log" | grep -a "OK \]\|FAILED \]" | head -12
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
