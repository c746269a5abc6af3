#!/usr/bin/env bash
# The topology loader's fuzz target alone: scripts/fuzz.sh [SECONDS] topology_loader_fuzz (kept
# for its old callers; extra arguments become libFuzzer flags).
#
#   scripts/fuzz_topology.sh [SECONDS] [extra libFuzzer flags...]     (default 60 s)
set -euo pipefail
secs=${1:-60}
[[ $# -gt 0 ]] && shift
PDSIM_FUZZ_FLAGS="${PDSIM_FUZZ_FLAGS:-} $*" exec "$(dirname "$0")/fuzz.sh" "$secs" topology_loader_fuzz
