#!/usr/bin/env bash
# scripts/check_format.sh must reject a misformatted file and accept it once --fix formatted it.
set -uo pipefail
repo="$1"
work="$(mktemp -d "$repo/tests/format/.self_test.XXXXXX")"
trap 'rm -rf "$work"' EXIT
printf 'int  main( ){return 0;}\n' >"$work/bad.cc"
if "$repo/scripts/check_format.sh" "$work/bad.cc" >/dev/null; then
  echo "FAIL: a misformatted file passed the check"; exit 1
fi
"$repo/scripts/check_format.sh" --fix "$work/bad.cc"
"$repo/scripts/check_format.sh" "$work/bad.cc" >/dev/null || { echo "FAIL: --fix did not format the file"; exit 1; }
echo "format_self_test: passed"
