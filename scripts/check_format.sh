#!/usr/bin/env bash
# Fails when a C++ or CUDA source is not formatted as .clang-format says (Google style, 100
# columns), naming each file; `scripts/check_format.sh --fix` formats them in place.
#   check_format.sh [--fix] [FILE...]   (default: every tracked .cc/.h/.cu/.cuh file)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
fix=0
if [[ "${1:-}" == "--fix" ]]; then fix=1; shift; fi
if (($#)); then
  files=("$@")
elif git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- '*.cc' '*.h' '*.cu' '*.cuh')
else
  mapfile -t files < <(find core kernels executor dispatcher apps bench bindings tests \
                         \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | sort)
fi
format="$(command -v clang-format-14 || command -v clang-format || true)"
[[ -n "$format" ]] || { echo "check_format: clang-format not found (scripts/setup.sh installs it)"; exit 1; }
if ((fix)); then
  "$format" -i "${files[@]}"
  exit 0
fi
bad=()
for file in "${files[@]}"; do
  "$format" --dry-run --Werror "$file" >/dev/null 2>&1 || bad+=("$file")
done
if ((${#bad[@]})); then
  printf 'check_format: not formatted: %s\n' "${bad[@]}"
  echo "check_format: ${#bad[@]} file(s); run scripts/check_format.sh --fix"
  exit 1
fi
echo "check_format: ${#files[@]} files formatted"
