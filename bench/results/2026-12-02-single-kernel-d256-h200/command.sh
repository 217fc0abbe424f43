#!/usr/bin/env bash
# One H200, one call (commit f54cd28's kernels): the test and benchmark binaries built on the
# development machine (Debian 12, LibTorch 2.11.0+cu130 from the venv, nvcc 13.0 for sm_90)
# carried to the GPU machine (`carry`: build/tests/hopper_tree_attention_test,
# build/bin/dta-attention-bench, .deps/usr) and run against its own torch libraries, no build there.
source scripts/device_prebuilt.sh
timeout 300 build/tests/hopper_tree_attention_test > $out/hopper_tree_attention_test.log 2>&1
timeout 150 build/bin/dta-attention-bench --head_dim=256 > $out/attention-bench-d256.log 2>&1
timeout 150 build/bin/dta-attention-bench --head_dim=128 > $out/attention-bench-d128.log 2>&1
