#!/usr/bin/env bash
# Prepares .deps/: the Debian packages the GPU machines lack (Abseil, simdjson), unpacked so the
# device's build can point CMAKE_PREFIX_PATH at .deps/usr, and the CUTLASS / CuTe headers of the
# pinned nvidia-cutlass wheel in .deps/cutlass/include for kernels/hopper/ (cmake/DtaCutlass.cmake).
# Run here (it needs Debian's apt); carry what a call needs to the device and build there with
# scripts/device_build.sh. The whole of .deps (61 MB) and the repository exceed a call's 64 MiB:
# kernels and benchmarks carry .deps/cutlass, .deps/usr and .deps/wheels; a services build adds
# .deps/services-debs (then 64 MB in all); the learning demo's Python pieces (.deps/python-wheels,
# .deps/python-stubs) follow in a second call on the warm machine, whose build-device and .deps
# stay.
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
# The gRPC services' libraries, for device builds with DTA_DEVICE_SERVICES=1: Debian 12's gRPC
# 1.51 and Protobuf 3.21 with the -dev packages their CMake configs look for, and xxHash's header
# (the dispatcher's fingerprints), kept as .deb files (16 MB; unpacked they would be 80) that
# scripts/device_build.sh unpacks on the device. A list that changes is fetched again.
services_debs=(libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29 libprotobuf-dev libprotobuf32
  protobuf-compiler libprotoc32 protobuf-compiler-grpc libre2-dev libre2-9 libc-ares-dev libc-ares2
  libssl-dev zlib1g-dev libcurl4-openssl-dev libxxhash-dev)
if [[ "$(cat "$deps/services-debs/.done" 2>/dev/null)" != "${services_debs[*]}" ]]; then
  rm -rf "$deps/services-debs"
  mkdir -p "$deps/services-debs"
  (cd "$deps/services-debs" && apt-get download "${services_debs[@]}")
  echo "${services_debs[*]}" >"$deps/services-debs/.done"
fi
# pytest for scripts/gpu_python.sh, as wheels (the machines have no package index).
if [[ ! -d "$deps/wheels" ]]; then
  "$repo/.venv/bin/python" -m pip download -q --no-deps -d "$deps/wheels" \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.3 Pygments==2.21.0
fi
# Flash Linear Attention's Triton kernels, the baseline of bench/gated_delta_baseline.py (the
# Gated DeltaNet rule a user of Qwen3-Next would otherwise train with), carried with
# .deps/wheels. A list that changes is fetched again.
fla_wheels="flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2"
if [[ "$(cat "$deps/wheels/.fla" 2>/dev/null)" != "$fla_wheels" ]]; then
  "$repo/.venv/bin/python" -m pip download -q --no-deps -d "$deps/wheels" $fla_wheels
  echo "$fla_wheels" >"$deps/wheels/.fla"
fi
# Python's gRPC for the learning demo's rollout worker on the GPU machines
# (scripts/gpu_learning_demo.sh): the grpcio and protobuf wheels of requirements.txt for the
# machines' Python 3.12 (7.7 MB), and the dispatcher's stubs generated here by grpcio-tools (the
# machines have none), again when the versions or the proto change.
grpc_wheels="grpcio==$(sed -n 's/^grpcio==//p' "$repo/scripts/requirements.txt") protobuf==$(sed -n 's/^protobuf==//p' "$repo/scripts/requirements.txt")"
if [[ "$(cat "$deps/python-wheels/.done" 2>/dev/null)" != "$grpc_wheels" ]]; then
  rm -rf "$deps/python-wheels"
  # shellcheck disable=SC2086 # two requirement specifiers
  "$repo/.venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$deps/python-wheels" \
    $grpc_wheels
  echo "$grpc_wheels" >"$deps/python-wheels/.done"
fi
proto="$repo/proto/dta/v1/dispatcher.proto"
stubs_key="$(sha256sum "$proto" | cut -c1-16) $grpc_wheels"
if [[ "$(cat "$deps/python-stubs/.done" 2>/dev/null)" != "$stubs_key" ]]; then
  rm -rf "$deps/python-stubs"
  mkdir -p "$deps/python-stubs"
  "$repo/.venv/bin/python" -m grpc_tools.protoc --proto_path="$repo/proto" \
    --python_out="$deps/python-stubs" --grpc_python_out="$deps/python-stubs" "$proto"
  echo "$stubs_key" >"$deps/python-stubs/.done"
fi
# The CUTLASS / CuTe headers (27 MB) of the nvidia-cutlass version pinned in
# requirements-headers.txt; the
# wheel itself is not kept, so that .deps stays small enough to carry.
cutlass_version="$(sed -n 's/^nvidia-cutlass==//p' "$repo/scripts/requirements-headers.txt")"
if [[ ! -f "$deps/cutlass/.done-$cutlass_version" ]]; then
  wheel_dir="$(mktemp -d)"
  "$repo/.venv/bin/python" -m pip download -q --no-deps -d "$wheel_dir" \
    "nvidia-cutlass==$cutlass_version"
  rm -rf "$deps/cutlass"
  "$repo/.venv/bin/python" - "$wheel_dir" "$deps/cutlass" <<'PY'
import glob, os, sys, zipfile
wheel_dir, dest = sys.argv[1], sys.argv[2]
prefix = "cutlass_library/source/include/"
(wheel,) = glob.glob(os.path.join(wheel_dir, "nvidia_cutlass-*.whl"))
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = os.path.join(dest, "include", name[len(prefix):])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(name) as src, open(target, "wb") as out:
                out.write(src.read())
PY
  rm -rf "$wheel_dir"
  touch "$deps/cutlass/.done-$cutlass_version"
fi
