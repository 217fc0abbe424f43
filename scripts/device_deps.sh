#!/usr/bin/env bash
# Prepares .deps/: the Debian packages the GPU machines lack (Abseil, simdjson), unpacked so the
# device's build can point CMAKE_PREFIX_PATH at .deps/usr. Run here (it needs Debian's apt); carry
# `.deps` to the device and build there with scripts/device_build.sh.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deps="$repo/.deps"
if [[ ! -f "$deps/.done" ]]; then
  rm -rf "$deps"
  mkdir -p "$deps/debs"
  (cd "$deps/debs" && apt-get download libabsl-dev libabsl20220623 libsimdjson-dev libsimdjson14)
  for deb in "$deps"/debs/*.deb; do dpkg-deb -x "$deb" "$deps"; done
  rm -rf "$deps/debs"
  touch "$deps/.done"
fi
# pytest for scripts/gpu_python.sh, as wheels (the machines have no package index).
if [[ ! -d "$deps/wheels" ]]; then
  "$repo/.venv/bin/python" -m pip download -q --no-deps -d "$deps/wheels" \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.3 Pygments==2.21.0
fi
