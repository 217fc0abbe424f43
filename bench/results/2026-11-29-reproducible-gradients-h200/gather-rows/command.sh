#!/usr/bin/env bash
# One H200: reproducible gradients. fused-residual-test/'s new test found Qwen3-Next's
# float32 gradients of layer 0's input norm and in_proj_qkvz differing between two runs of the
# same step (index_add_'s atomics summing a gather's repeated rows in a varying order: the
# embedding, the convolution's inputs, a branch point's predictions). GatherRows / AddRowsInto
# (executor/model/gather_rows.h) sum them in a fixed order:
#  1. gather_rows_test (200,000 float32 rows into 3 slots: the same bits on every run);
#  2. gpu_equivalence_test: EveryGradientIsBitwiseReproducible (float32 and bf16; dta, packed,
#     dense; every family), FusedResidualGradientIsBitwiseAutogradsSum (the embedding now compared
#     bitwise too), and the rest.
set -uo pipefail
export DTA_DEVICE_TARGETS="gather_rows_test gpu_equivalence_test"
source scripts/device_session.sh
run_gtests gather_rows_test gpu_equivalence_test
grep -a "Reproducible\|FusedResidual\|AddRowsInto" "$out/all/gpu_equivalence_test.log" "$out/all/gather_rows_test.log" | grep -a "OK\|FAILED" | head -14
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
