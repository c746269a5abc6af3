#!/usr/bin/env bash
# Installs what is missing, builds pdsim and runs its tests (ctest).
#   scripts/test.sh                 release build, all tests except label `slow`
#   PDSIM_TEST_ALL=1 scripts/test.sh   include `slow` tests
#   PDSIM_SANITIZERS=1 scripts/test.sh also build the asan and tsan presets and run their suites
#                                      (on by default when CI=true)
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$PDSIM_ROOT"
mkdir -p build
start=$(date +%s)

pdsim_bootstrap
# BUILD_TESTING=ON explicitly: scripts/run.sh configures the same build folder without tests.
pdsim_build default -DBUILD_TESTING=ON

exclude=(-LE slow)
[ "${PDSIM_TEST_ALL:-0}" = "1" ] && exclude=()
echo "== ctest (default)"
ctest --preset default --no-tests=error "${exclude[@]}" -j "$PDSIM_JOBS"

sanitizers="${PDSIM_SANITIZERS:-}"
if [ -z "$sanitizers" ] && [ "${CI:-}" = "true" ]; then sanitizers=1; fi
if [ "$sanitizers" = "1" ]; then
  # Memory code under ASan/UBSan, concurrency code under TSan (tests labelled `tsan`).
  # Memory code (kernels, pools, parsers, model) under ASan/UBSan; the transport and engine suites
  # are concurrency code and run under TSan below. The ISA-forced variants of cpu_attention_test
  # repeat the same memory accesses: run it once. Leak checking is off until every suite (and the
  # pdsim binary the CLI tests spawn) has been brought to zero leaks under LSan.
  # Both sanitizer presets compile at -O1 -g1 (CMakePresets.json): GCC's UBSan at -O2 -g took
  # 250 s of CPU for the largest translation unit, 96 s at -O1 -g1; -g1 keeps the line tables the
  # reports print.
  asan_sel=(-L unit -LE slow -E '(_(avx2|scalar)|^transport_.*|^transfer_engine_.*|^fault_transport_test|^bench_transfer_test)$')
  pdsim_configure asan -DBUILD_TESTING=ON
  pdsim_build_tests asan "${asan_sel[@]}"
  echo "== ctest (asan: unit)"
  # Under ASan (ten times slower) the cpu_attention_test matrix runs at page size 16 only (the ISA
  # variants' cut, tests/CMakeLists.txt) and calibrate's quick run (93 s: the attention benchmarks
  # it fits, already checked by cpu_attention_test) is left to the release suite.
  asan_filter="-AllCombinations/CpuVsRef.*_ps1_*:AllCombinations/CpuVsRef.*_ps64_*"
  asan_filter+=":CalibrateCli.QuickRunWritesALoadableFileWithSaneFits"
  GTEST_FILTER="$asan_filter" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --preset asan --no-tests=error "${asan_sel[@]}" -j "$PDSIM_JOBS"
  tsan_sel=(-L tsan -LE slow)
  pdsim_configure tsan -DBUILD_TESTING=ON
  pdsim_build_tests tsan "${tsan_sel[@]}"
  echo "== ctest (tsan: label tsan)"
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
    ctest --preset tsan --no-tests=error "${tsan_sel[@]}" -j "$PDSIM_JOBS"
fi
echo "== test.sh: all passed in $(( $(date +%s) - start )) s"
