#!/bin/bash
# The Hopper tree-attention backward at head dim 128: the dQ and dK/dV kernels (the default) beside
# the opt-in single kernel (DTA_HOPPER_ATTENTION_BACKWARD_FUSED=1), in one run of
# dta-attention-bench, after hopper_tree_attention_test (both backwards against the float64
# reference, FlashAttention-2 and each other). One H200; run from the repository root on the device
# machine (carry .deps/cutlass .deps/usr .deps/wheels).
export DTA_DEVICE_TARGETS="hopper_tree_attention_test dta-attention-bench" DTA_DEVICE_BUILD_TIMEOUT=420
source scripts/device_session.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt"
timeout 150 build-device/tests/hopper_tree_attention_test > "$out/hopper_tree_attention_test.log" 2>&1
echo "hopper_tree_attention_test rc $? at $((SECONDS - start)) s"
grep -a -E "^\[  (PASSED|FAILED)|Failure" "$out/hopper_tree_attention_test.log" | head -10
timeout 150 build-device/bin/dta-attention-bench --head_dim=128 > "$out/attention-d128.md" 2>&1
echo "dta-attention-bench rc $? at $((SECONDS - start)) s"
grep -a "^| " "$out/attention-d128.md" | grep -a "Hopper bwd\|flash" | cut -c1-170
