#!/usr/bin/env bash
# Installs what is missing, builds pdsim and runs the built-in default experiment, printing its
# summary. Until the testbed lands, the default experiment is the attention benchmark:
# the cpu backend's decode and extend throughput against a STREAM copy and OpenBLAS sgemm.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$PDSIM_ROOT"
mkdir -p build out
pdsim_bootstrap
pdsim_build default -DBUILD_TESTING=OFF
echo "== pdsim bench attention"
"$PDSIM_ROOT/build/default/sim/pdsim" bench attention --json out/bench_attention.json "$@"
echo "== wrote out/bench_attention.json"
