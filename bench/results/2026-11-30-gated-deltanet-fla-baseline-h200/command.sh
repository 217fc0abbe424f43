#!/usr/bin/env bash
# Both device calls of this record, from the repo root on the GPU machine, .deps/cutlass,
# .deps/usr and .deps/wheels carried (scripts/device_deps.sh fetches FLA's pinned wheels there).
export DTA_DEVICE_TARGETS="dta-linear-attention-bench" DTA_DEVICE_BUILD_TIMEOUT=420
source scripts/device_session.sh
# Call 1: dta's rule and whole mixer, ATen intra-chunk ops against the fused kernels, with a
# profile of the fused path.
build-device/bin/dta-linear-attention-bench --device=cuda --tokens=4096,16384 --what=rule,mix \
  --profile=$out/dta_profile.md | tee $out/dta_rule_mix.txt
# Call 2: FLA's rule, then dta's again in the same call.
python3 -m pip install -q --no-index --no-deps --target /tmp/fla .deps/wheels/fla_core-*.whl \
  .deps/wheels/flash_linear_attention-*.whl .deps/wheels/einops-*.whl
PYTHONPATH=/tmp/fla python3 bench/gated_delta_baseline.py --tokens=4096,16384 | tee $out/fla.txt
build-device/bin/dta-linear-attention-bench --device=cuda --tokens=16384 --what=rule \
  | grep "^|" | tee $out/dta_rule.txt
