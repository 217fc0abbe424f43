# Sourced on the GPU machine to run test and benchmark binaries built on the development machine
# instead of building there (3-4 minutes of each call's device time): the two machines share
# LibTorch 2.11.0+cu130 and nvcc 13.0, and the build targets sm_90. Carry the binaries and Debian's
# libraries with the call (`carry`: build/tests/NAME, build/bin/NAME, .deps/usr); this puts the GPU
# machine's torch and NVIDIA libraries and the carried Debian ones (Abseil) ahead of the binaries'
# run path, which names the development machine's venv. Sets $out (the call's $OUT).
#
#   source scripts/device_prebuilt.sh && build/tests/hopper_tree_attention_test
torch_dir=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")
site_dir=$(dirname "$torch_dir")
nvidia_libs=$(ls -d "$site_dir"/nvidia/*/lib "$site_dir"/nvidia/cu13/lib 2>/dev/null | tr '\n' ':')
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:$torch_dir/lib:$nvidia_libs/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
