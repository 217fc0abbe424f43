#!/usr/bin/env bash
# The Python package on a GPU machine: builds the extension dta._core with CMake (the machines have
# neither scikit-build-core nor grpcio-tools, so no pip install: the package is assembled from
# bindings/python/dta and the built module) and runs its trainer tests there, the CUDA ones
# included (tests/python/test_trainer_gpu.py). Needs .deps/ carried (scripts/device_deps.sh). The
# machines have no tensorboardX, which reads event files back in the tests: without it the
# TensorBoard tests are deselected (said on the first line), the rest runs.
#
#   scripts/gpu_python.sh [PYTEST ARGS...]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${DTA_PYTHON:-$(command -v python3)}"
export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
build=build-device-python
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$repo/.deps/usr;$repo/.deps/usr/lib/x86_64-linux-gnu/cmake" -DDTA_PYTHON="$python" \
  -DDTA_BUILD_PYTHON=ON -DDTA_BUILD_TOOLS=OFF -DDTA_BUILD_TESTS=OFF -DDTA_BUILD_BENCH=OFF \
  -DDTA_BUILD_SERVICES=OFF >"$build.configure.log" 2>&1 || { tail -30 "$build.configure.log"; exit 1; }
cmake --build "$build" --target dta_python -j"$(nproc)" >"$build.log" 2>&1 || { tail -40 "$build.log"; exit 1; }
site="$build/site"
rm -rf "$site" && mkdir -p "$site"
cp -r bindings/python/dta "$site/dta"
cp "$build"/python/dta/_core*.so "$site/dta/"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
deselect=()
if ! "$python" -c "import tensorboardX" 2>/dev/null; then
  echo "gpu_python: no tensorboardX here: the TensorBoard tests are deselected"
  deselect=(--deselect "tests/python/test_trainer.py::test_tensorboard_scalars_of_every_train_batch")
fi
PYTHONPATH="$repo/$site:$repo/tests/python${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pytest -q -rs -s \
  tests/python/test_trainer_gpu.py tests/python/test_trainer.py tests/python/test_tree.py "${deselect[@]}" "$@"
