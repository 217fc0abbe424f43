# Sourced by a device call's script (bench/results/latest/*/run*.sh): the environment every GPU
# run needs, $out (the call's $OUT), $start, and one build of the working tree with the Python
# extension, whose package it lays out in $site for PYTHONPATH. Exits the script with the build's
# tail if the build fails (the gRPC Python stubs, which need grpc_tools, may fail: nothing here
# uses them).
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
start=$SECONDS
timeout 280 scripts/device_build.sh -DDTA_BUILD_PYTHON=ON -DDTA_BUILD_SERVICES=OFF >"$out/build.log" 2>&1 ||
  grep -q "No module named 'grpc_tools'" "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
site=build-device/site && rm -rf "$site" && mkdir -p "$site" && cp -r bindings/python/dta "$site/dta" &&
  cp build-device/python/dta/_core*.so "$site/dta/"
echo "built at $((SECONDS - start)) s"
