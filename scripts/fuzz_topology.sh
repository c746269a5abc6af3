#!/usr/bin/env bash
# Builds the topology loader's libFuzzer target with clang (libFuzzer + ASan + UBSan) in its own
# build dir and runs it on a seed corpus made from topology/examples, the malformed test files and
# topology/fuzz/seeds.
#
#   scripts/fuzz_topology.sh [SECONDS] [extra libFuzzer flags...]     (default 60 s)
#
# Env: PDSIM_FUZZ_BUILD_DIR (default build/fuzz), PDSIM_FUZZ_JOBS (build jobs, default 2).
# Exit status: 0 clean run, 2 no clang++, otherwise the fuzzer's (crashes are saved as
# crash-* / leak-* / timeout-* files in the build dir).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-60}
[[ $# -gt 0 ]] && shift
build=${PDSIM_FUZZ_BUILD_DIR:-$root/build/fuzz}

if ! command -v clang++ >/dev/null 2>&1 || ! command -v clang >/dev/null 2>&1; then
    echo "fuzz_topology.sh: clang/clang++ not found; the fuzzer needs clang's libFuzzer" >&2
    exit 2
fi

CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPDSIM_FUZZ=ON -DPDSIM_SANITIZER=address \
    -DPDSIM_WITH_CUDA=OFF -DPDSIM_BUILD_BENCH=OFF -DBUILD_TESTING=OFF >"$build.configure.log" 2>&1 ||
    { cat "$build.configure.log" >&2; exit 1; }
cmake --build "$build" --target topology_loader_fuzz -j "${PDSIM_FUZZ_JOBS:-2}"

corpus=$build/topology_corpus
mkdir -p "$corpus"
cp "$root"/topology/examples/*.yaml "$root"/tests/data/topology/bad/*.yaml \
   "$root"/topology/fuzz/seeds/* "$corpus"/

cd "$build"
exec "$build/topology/topology_loader_fuzz" \
    -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
    -dict="$root/topology/fuzz/topology.dict" -print_final_stats=1 "$@" "$corpus"
