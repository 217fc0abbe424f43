# Sourced by a device call's script (bench/results/*/command.sh): the environment every GPU
# run needs, $out (the call's $OUT), $start, and one build of the working tree with the Python
# extension, whose package it lays out in $site for PYTHONPATH. Exits the script with the build's
# tail if the build fails or runs past DTA_DEVICE_BUILD_TIMEOUT seconds (default 330; the gRPC
# Python stubs, which need grpc_tools, may fail: nothing here uses them). DTA_DEVICE_TARGETS
# (space-separated) builds only those targets (scripts/device_build.sh); DTA_DEVICE_SERVICES=1
# builds the gRPC services too, against the Debian packages carried in .deps/services-debs, and
# puts their libraries on LD_LIBRARY_PATH for the binaries.
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
start=$SECONDS
services=OFF
if [[ "${DTA_DEVICE_SERVICES:-0}" == 1 ]]; then
  services=ON
  export LD_LIBRARY_PATH="$PWD/build-device/services-root/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH"
fi
timeout "${DTA_DEVICE_BUILD_TIMEOUT:-330}" scripts/device_build.sh -DDTA_BUILD_PYTHON=ON \
  -DDTA_BUILD_SERVICES="$services" >"$out/build.log" 2>&1
build_rc=$?
if ((build_rc == 124)); then
  echo "build: timed out after $((SECONDS - start)) s"; tail -5 "$out/build.log"; exit 1
fi
if ((build_rc != 0)) && ! grep -q "No module named 'grpc_tools'" "$out/build.log"; then
  tail -30 "$out/build.log"; exit 1
fi
site=build-device/site && rm -rf "$site" && mkdir -p "$site" && cp -r bindings/python/dta "$site/dta"
# The extension, unless DTA_DEVICE_TARGETS left it out.
if compgen -G "build-device/python/dta/_core*.so" >/dev/null; then
  cp build-device/python/dta/_core*.so "$site/dta/"
fi
echo "built at $((SECONDS - start)) s"

# run_gtests NAME...: each GoogleTest binary of build-device/tests, its log in $out/all/NAME.log,
# one line of counts per binary and the first failures.
run_gtests() {
  mkdir -p "$out/all"
  local t
  for t in "$@"; do
    timeout 200 "build-device/tests/$t" >"$out/all/$t.log" 2>&1
    echo "$t exit $?: $(grep -a -c -E '^\[       OK' "$out/all/$t.log") ok, $(grep -a -c -E '^\[  FAILED' "$out/all/$t.log") failed at $((SECONDS - start)) s"
    grep -a -E "Failure" -A4 "$out/all/$t.log" | head -12
  done
}

# tau2_batches, bench_step: scripts/device_steps.sh.
source scripts/device_steps.sh
