#!/usr/bin/env bash
# One H200: the fused layers on a chunk of no tokens (RoPE's tables were
# reshaped with an inferred dimension, which a [0, 1, D] table cannot give); fused_layers_test,
# EveryLayerTakesAChunkOfNoTokens among its tests.
set -uo pipefail
export DTA_DEVICE_TARGETS="fused_layers_test"
source scripts/device_session.sh
run_gtests fused_layers_test
grep -a "EveryLayerTakesAChunkOfNoTokens" "$out/all/fused_layers_test.log"
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
