#!/usr/bin/env bash
# One H200, two calls: the test and benchmark binaries built on the development machine (Debian 12,
# LibTorch 2.11.0+cu130 from the venv, nvcc 13.0 for sm_90) carried to the GPU machine
# (`carry`: build/tests/hopper_tree_attention_test, build/bin/dta-attention-bench, .deps/usr for
# Debian's Abseil) and run against the GPU machine's own torch 2.11.0+cu130 libraries, without a
# build there.
TS=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))"); SP=$(dirname $TS)
export LD_LIBRARY_PATH=$PWD/.deps/usr/lib/x86_64-linux-gnu:$TS/lib:$(ls -d $SP/nvidia/*/lib $SP/nvidia/cu13/lib 2>/dev/null | tr '\n' ':'):/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# First call (commit b3a3d1f): every case.
timeout 90 build/tests/hopper_tree_attention_test > $OUT/hopper_tree_attention_test.log 2>&1
# Second call (the selection test updated): the two tests the change touches, then the benchmark.
timeout 20 build/tests/hopper_tree_attention_test --gtest_filter='*EnvironmentSelectsTheKernel*:*HeadDim64*' > $OUT/hopper_tree_attention_test.log 2>&1
timeout 45 build/bin/dta-attention-bench --head_dim=64 --ours_only > $OUT/attention-bench-d64.log 2>&1
