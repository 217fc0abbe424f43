#!/usr/bin/env bash
# The learning demo (examples/python/learning_demo.py: a policy learns the tool-use task through
# dta's services, dense and dta side by side) on a GPU machine, which has torch and transformers
# but neither Python's gRPC nor a package index: the grpcio and protobuf wheels and the dispatcher's
# stubs that scripts/device_deps.sh keeps in .deps are unpacked into a site directory with the dta
# package. Needs the services built first (DTA_DEVICE_SERVICES=1 scripts/device_build.sh
# -DDTA_BUILD_SERVICES=ON, targets dta-dispatcher and dta-trainer). Arguments go to
# learning_demo.py (e.g. --steps=40 --ranks=1).
#   DTA_PYTHON (python3), DTA_BUILD_DIR (build-device), DTA_DEMO_DEVICE (cuda),
#   DTA_PYTHON_WHEELS (.deps/python-wheels: wheels for DTA_PYTHON's version)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${DTA_PYTHON:-python3}"
build="${DTA_BUILD_DIR:-build-device}"
wheels="${DTA_PYTHON_WHEELS:-$repo/.deps/python-wheels}"
site="$build/demo-site"
compgen -G "$wheels/*.whl" >/dev/null || {
  echo "gpu_learning_demo.sh: no wheels in $wheels (run scripts/device_deps.sh)" >&2
  exit 1
}
rm -rf "$site" && mkdir -p "$site"
cp -r bindings/python/dta "$site/dta"
cp "$repo"/.deps/python-stubs/dta/v1/*_pb2*.py "$site/dta/v1/"
# A wheel is a zip archive: unpacked, its packages import without pip.
"$python" - "$site" "$wheels"/*.whl <<'PY'
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
PY
export PYTHONPATH="$repo/$site${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$repo/$build/services-root/usr/lib/x86_64-linux-gnu:$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
exec "$python" examples/python/learning_demo.py --build_dir="$build" \
  --device="${DTA_DEMO_DEVICE:-cuda}" "$@"
