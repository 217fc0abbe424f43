#!/usr/bin/env bash
# Installs whatever is missing for building and testing dta on Debian 12: the Debian packages
# and the repo's Python venv (.venv, pinned by scripts/requirements.txt, then AReaL and what it
# imports by scripts/requirements-areal.txt without dependency resolution: see that file).
# Idempotent: when nothing changed it checks and returns in about a second.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

apt_packages=(
  build-essential cmake ninja-build ccache git pkg-config python3 python3-venv python3-dev
  libabsl-dev libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  libgtest-dev libgmock-dev libbenchmark-dev libsimdjson-dev nlohmann-json3-dev zlib1g-dev libxxhash-dev
  clang clang-format libclang-rt-14-dev openssl libcurl4-openssl-dev
)
missing=()
for package in "${apt_packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  $sudo apt-get update -q
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

venv="$repo/.venv"
requirements="$repo/scripts/requirements.txt"
requirements_areal="$repo/scripts/requirements-areal.txt"
requirements_headers="$repo/scripts/requirements-headers.txt"
stamp="$venv/.requirements.sha256"
want="$(cat "$requirements" "$requirements_areal" "$requirements_headers" | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "setup: creating the Python venv in .venv"
  python3 -m venv "$venv"
fi
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "setup: installing pinned Python packages (torch is large: the first time takes minutes)"
  "$venv/bin/python" -m pip install -q --upgrade pip==26.3
  "$venv/bin/python" -m pip install -q -r "$requirements"
  # --no-deps: areal declares torch<2.11, and dta's extension links the venv's torch.
  "$venv/bin/python" -m pip install -q --no-deps -r "$requirements_areal"
  "$venv/bin/python" -m pip install -q --no-deps -r "$requirements_headers"
  echo "$want" >"$stamp"
fi
