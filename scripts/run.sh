#!/usr/bin/env bash
# Installs what is missing, builds pdsim and runs the built-in default experiment, the testbed:
#   mpirun --oversubscribe -np 2 build/default/sim/pdsim testbed --mode both
# (topology cpu-1p1d: 1 prefill rank and 1 decode rank; the tiny model; a 16-request sample of the
# Mooncake conversation trace), which prints a summary table and writes out/report.json,
# out/timeline.json (open in ui.perfetto.dev) and out/requests.csv; then plots the report
# (out/ttft_cdf.png, tpot_cdf.png, layer_latency.png, overlap.png). Extra arguments go to
# `pdsim testbed` (e.g. --sample 64, --layerwise off). docs/testbed.md explains the output.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$PDSIM_ROOT"
mkdir -p build out
pdsim_require_disk "$PDSIM_DISK_RELEASE_MIB" "the release build"
pdsim_bootstrap
pdsim_build default -DBUILD_TESTING=OFF
# OpenMPI's ob1 PML with shared memory (and TCP across hosts), as the tests use.
export OMPI_MCA_pml="${OMPI_MCA_pml:-ob1}" OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader,tcp}"
echo "== pdsim testbed --mode both (mpirun -np 2)"
status=0
mpirun --oversubscribe -np 2 build/default/sim/pdsim testbed --mode both --progress \
  --report out/report.json --timeline out/timeline.json --requests out/requests.csv "$@" || status=$?
if [ -f out/report.json ]; then
  echo "== plots"
  /usr/bin/python3 scripts/plot_report.py out/report.json --out out
fi
exit "$status"
