#!/usr/bin/env bash
# The Python package on a GPU machine: builds it (scripts/device_python.sh) and runs its trainer
# tests there, the CUDA ones included (tests/python/test_trainer_gpu.py). Needs .deps/ carried
# (scripts/device_deps.sh). The machines have no tensorboardX, which reads event files back in the tests: without it the
# TensorBoard tests are deselected (said on the first line), the rest runs.
#
#   scripts/gpu_python.sh [PYTEST ARGS...]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${DTA_PYTHON:-$(command -v python3)}"
export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
site="$(scripts/device_python.sh)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
deselect=()
if ! "$python" -c "import tensorboardX" 2>/dev/null; then
  echo "gpu_python: no tensorboardX here: the TensorBoard tests are deselected"
  deselect=(--deselect "tests/python/test_trainer.py::test_tensorboard_scalars_of_every_train_batch")
fi
PYTHONPATH="$site:$repo/tests/python${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pytest -q -rs -s \
  tests/python/test_trainer_gpu.py tests/python/test_trainer.py tests/python/test_tree.py "${deselect[@]}" "$@"
