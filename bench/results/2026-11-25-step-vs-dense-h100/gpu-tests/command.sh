#!/usr/bin/env bash
# The GPU tests of commit 0e35b7e on an H100 (packing on by default,
# the leaner Hopper backward): the kernels' and the executor's CUDA tests, and the Python trainer's
# CUDA tests against the float64 CPU reference. Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
for t in hopper_tree_attention_test gpu_equivalence_test fused_layers_test chunk_attention_test; do
  timeout 200 build-device/tests/$t >"$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -a -E "Failure" -A3 "$out/$t.log" | head -12
done
PYTHONPATH="$site:$PWD/tests/python" timeout 200 python3 -m pytest -q -rs tests/python/test_trainer_gpu.py \
  >"$out/test_trainer_gpu.log" 2>&1
echo "test_trainer_gpu exit $?: $(tail -1 "$out/test_trainer_gpu.log")"
echo "done at $((SECONDS - start)) s"
