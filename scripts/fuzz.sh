#!/usr/bin/env bash
# Builds pdsim's libFuzzer targets (fuzz/: libFuzzer + ASan + UBSan, clang) in their own build dir
# and runs each for SECONDS on a corpus seeded from the repository's real inputs and fuzz/seeds.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]      (default 60 s, every target; docs/inputs.md)
#
# Targets: topology_loader_fuzz trace_jsonl_fuzz trace_azure_fuzz model_file_fuzz cost_file_fuzz
#          tcp_frame_fuzz control_codec_fuzz testbed_protocol_fuzz journal_fuzz
# Env: PDSIM_FUZZ_BUILD_DIR (default build/fuzz), PDSIM_FUZZ_JOBS (build jobs, default 2),
#      PDSIM_FUZZ_PARALLEL (targets run at once, default 2), PDSIM_FUZZ_FLAGS (extra libFuzzer
#      flags). Corpora persist in <build>/corpus/<target>; logs in <build>/logs/<target>.log.
# Prints one summary line per target (execs, coverage, crashes). Exit status: 0 when no target
# crashed; 1 when one did (its inputs are saved in <build>/crashes/<target>/: reproduce with
# `<build>/fuzz/<target> <file>`, then add the file to fuzz/regressions/<target>/); 2 when
# clang or libFuzzer is missing or an argument is bad.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
all_targets=(topology_loader_fuzz trace_jsonl_fuzz trace_azure_fuzz model_file_fuzz
             cost_file_fuzz tcp_frame_fuzz control_codec_fuzz testbed_protocol_fuzz journal_fuzz)
secs=${1:-60}
[[ $# -gt 0 ]] && shift
if ! [[ "$secs" =~ ^[0-9]+$ ]] || [ "$secs" -lt 1 ]; then
    echo "fuzz.sh: SECONDS must be a positive integer, got '$secs'" >&2
    exit 2
fi
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
    if [[ ! " ${all_targets[*]} " =~ " $t " ]]; then
        echo "fuzz.sh: unknown target '$t' (known: ${all_targets[*]})" >&2
        exit 2
    fi
done
build=${PDSIM_FUZZ_BUILD_DIR:-$root/build/fuzz}
parallel=${PDSIM_FUZZ_PARALLEL:-2}
read -r -a extra_flags <<<"${PDSIM_FUZZ_FLAGS:-}"

# ---- clang and libFuzzer ----
if ! command -v clang++ >/dev/null 2>&1 || ! command -v clang >/dev/null 2>&1; then
    echo "fuzz.sh: clang/clang++ not found; the fuzz targets need clang's libFuzzer" \
         "(Debian: apt-get install clang)" >&2
    exit 2
fi
mkdir -p "$build"
probe=$build/.libfuzzer-probe
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) {
              return 0; }' |
        clang++ -fsanitize=fuzzer,address,undefined -x c++ - -o "$probe" >/dev/null 2>&1; then
    echo "fuzz.sh: clang++ cannot link -fsanitize=fuzzer,address,undefined: libFuzzer or the" \
         "sanitizer runtimes are missing (Debian: the clang package's libclang-rt)" >&2
    exit 2
fi
rm -f "$probe"

# ---- build (only the fuzz targets and what they compile) ----
CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPDSIM_FUZZ=ON -DPDSIM_SANITIZER=address \
    -DPDSIM_WITH_CUDA=OFF -DPDSIM_BUILD_BENCH=OFF -DBUILD_TESTING=OFF -DPDSIM_UNITY_BUILD=ON \
    >"$build/configure.log" 2>&1 || { cat "$build/configure.log" >&2; exit 1; }
echo "== fuzz: build ${targets[*]}"
cmake --build "$build" --target "${targets[@]}" -j "${PDSIM_FUZZ_JOBS:-2}" >"$build/build.log" 2>&1 ||
    { tail -50 "$build/build.log" >&2; exit 1; }

# ---- seeds: the repository's real inputs (small heads of the traces), fuzz/seeds, and the
# crash regressions ----
max_len_of() {
    case "$1" in
        topology_loader_fuzz) echo 65536 ;;
        trace_jsonl_fuzz | trace_azure_fuzz) echo 16384 ;;
        cost_file_fuzz | testbed_protocol_fuzz | journal_fuzz) echo 8192 ;;
        *) echo 4096 ;;
    esac
}
seed() {
    local t=$1 dir=$build/seeds/$1
    rm -rf "$dir"
    mkdir -p "$dir"
    [ -d "$root/fuzz/seeds/$t" ] && cp "$root/fuzz/seeds/$t"/* "$dir"/
    [ -d "$root/fuzz/regressions/$t" ] && cp "$root/fuzz/regressions/$t"/* "$dir"/
    local f
    case "$t" in
        topology_loader_fuzz)
            cp "$root"/topology/examples/*.yaml "$root"/tests/data/topology/bad/*.yaml "$dir"/ ;;
        trace_jsonl_fuzz)
            for f in "$root"/data/traces/*.jsonl; do head -n 20 "$f" >"$dir/head-$(basename "$f")"; done ;;
        trace_azure_fuzz)
            for f in "$root"/data/traces/*.csv; do head -n 40 "$f" >"$dir/head-$(basename "$f")"; done ;;
        model_file_fuzz) cp "$root"/data/models/* "$dir"/ ;;
        *) ;;
    esac
}

# ---- run ----
run_one() {
    local t=$1
    local corpus=$build/corpus/$t crashes=$build/crashes/$t log=$build/logs/$t.log
    mkdir -p "$corpus" "$crashes" "$build/logs"
    rm -f "$build/logs/$t.rc"
    local dict=()
    [ -f "$root/fuzz/dict/$t.dict" ] && dict=(-dict="$root/fuzz/dict/$t.dict")
    local rc=0
    "$build/fuzz/$t" -max_total_time="$secs" -max_len="$(max_len_of "$t")" -timeout=10 \
        -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$crashes/" "${dict[@]}" \
        ${extra_flags[@]+"${extra_flags[@]}"} "$corpus" "$build/seeds/$t" >"$log" 2>&1 || rc=$?
    echo "$rc" >"$build/logs/$t.rc"
}
summary() {
    local t=$1 log=$build/logs/$1.log
    local rc execs cov ft corp crashes
    rc=$(cat "$build/logs/$t.rc")
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$log" | tail -1 || true)
    crashes=$(find "$build/crashes/$t" -type f -newer "$build/logs/.run-start" | wc -l)
    printf '%-22s execs %-10s %-34s new crash files %s, exit %s%s\n' "$t" "${execs:-?}" \
        "${cov:-cov: ?}" "$crashes" "$rc" "$([ "$rc" != 0 ] && echo "  <- CRASH: $log")"
}

for t in "${targets[@]}"; do seed "$t"; done
mkdir -p "$build/logs"
touch "$build/logs/.run-start"  # crash files older than this run are not counted
echo "== fuzz: ${#targets[@]} targets, ${secs} s each, ${parallel} at a time"
running=0
for t in "${targets[@]}"; do
    if [ "$running" -ge "$parallel" ]; then
        wait -n || true
        running=$((running - 1))
    fi
    run_one "$t" &
    running=$((running + 1))
done
wait || true

failed=0
for t in "${targets[@]}"; do
    summary "$t"
    [ "$(cat "$build/logs/$t.rc")" = 0 ] || failed=1
done
if [ "$failed" != 0 ]; then
    echo "fuzz.sh: a target crashed; inputs in $build/crashes/<target>/ (see the logs)" >&2
fi
exit "$failed"
