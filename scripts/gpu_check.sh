#!/usr/bin/env bash
# One-shot GPU check, for a machine with an NVIDIA GPU, in under 8 minutes whatever hangs: runs
# every test labelled `cuda` (among them the testbed 1P1D on one GPU in --mode both,
# testbed_gpu_disagg_test, and the faulted runs, testbed_gpu_fault_test), the same 1P1D as two
# processes on one GPU under mpirun (scripts/gpu_two_process.sh: KV over CUDA IPC handles between
# the processes; the bundle's own Open MPI where the machine has none), and TP 2 prefill -> TP 1
# decode as three processes on that GPU (the same script, PDSIM_GPU_TWO_PROCESS_PREFILL_TP=2: GPU
# tensor parallelism over MPI, heterogeneous TP over CUDA IPC), the layerwise on/off pair
# (scripts/gpu_layerwise.sh: 4096-token llama3-8b prompts on gpu-1p1d at 50 GB/s and at the
# transfer == prefill rate), the fidelity pair (scripts/gpu_fidelity.sh: a GPU testbed run,
# calibrate --from-timeline on it, simulate of the same run), `pdsim bench transfer --transport
# cuda_ipc` (the cuda_ipc transport's completion poller vs raw cudaMemcpyAsync) and `pdsim bench
# attention --backend cuda` (decode vs a device-to-device copy, causal extend vs a cuBLASLt GEMM,
# the GPU model per layer vs the roofline cost model), and prints a markdown table (also
# $OUT/summary.md) with pass/fail against the targets (docs/gpu-results.md "Ready to run"). Run
# from anywhere: bash scripts/gpu_check.sh
#
# Binaries: when every build dependency is there (CMake configures), it builds pdsim and the cuda
# tests in build/gpu; otherwise it uses the bundle .gpu/ made by scripts/gpu_bundle.sh on another
# machine (its files over 64 KiB stored xz-compressed: it unpacks a copy into its scratch folder,
# with xz or else Python's lzma), started through the bundle's own loader so it runs on any glibc.
# It installs nothing.
# It finds the driver's libcuda.so.1 and a libnccl.so.2 (pip nvidia-nccl-cu13, ldconfig, CUDA
# dirs) itself; with no NCCL the bundle's stub stands in and the nccl tests skip. The bundle leaves
# cuBLAS out too (.gpu/cublas.txt names what its binaries load, e.g. libcublasLt.so.13): it is
# found in pip's nvidia-cublas (nvidia/cu13/lib, nvidia/cublas/lib), ldconfig or /usr/local/cuda*;
# without it the binaries that link cuBLAS do not load, and the table says so.
#
# Writes to $OUT (default out/): summary.md, env.txt (what it found), build.log (when it tried to
# build), tests.log (all gtest output), bench.log (both benches' output), bench_cuda_ipc.json,
# bench_attention_cuda.json, two_process.log and two_process/ (gpu_two_process.sh's JSON, report
# and log), two_process_tp2.log and two_process_tp2/ (its TP 2 run), layerwise.log and layerwise/ (gpu_layerwise.sh's JSON, table, reports and logs),
# fidelity.log and fidelity/ (gpu_fidelity.sh's).
# Time: each test binary gets at most 120 s, and the tests together leave PDSIM_GPU_TWO_PROCESS_S
# + PDSIM_GPU_TP2_S + PDSIM_GPU_LAYERWISE_S + PDSIM_GPU_FIDELITY_S + PDSIM_GPU_BENCH_RESERVE_S of
# the budget to what follows: the two-process run (at most PDSIM_GPU_TWO_PROCESS_S), the TP 2 run
# (at most PDSIM_GPU_TP2_S), the layerwise pair (at most PDSIM_GPU_LAYERWISE_S, 40 s per testbed
# run), then the fidelity pair (at most
# PDSIM_GPU_FIDELITY_S, leaving the benches their reserve), then the benchmarks (bench transfer at
# most 100 s, bench attention at most 120 s, within what is left). A missed target shows as FAIL in
# the table; it does not change the exit status (as the benches' BELOW).
# The cuda tests that run pdsim (bench_attention_cuda_gpu_test, testbed_gpu_test: `pdsim testbed
# --backend cuda --mode colocated --topology gpu-1c`; testbed_gpu_disagg_test and
# testbed_gpu_fault_test: `--mode both|disagg --topology gpu-1p1d`, KV over cuda_ipc) get it
# through $PDSIM_GPU_TEST_PDSIM (the bundle's pdsim behind its loader, or the one built here); the
# bundle carries the example topologies in .gpu/share/pdsim/topologies, where both binaries find
# them by name.
# Env: PDSIM_GPU_MODE=auto|build|bundle (auto), PDSIM_GPU_BUILD_DIR (build/gpu),
#      PDSIM_GPU_CHECK_BUDGET_S (450: the whole run), PDSIM_GPU_TWO_PROCESS_S (40),
#      PDSIM_GPU_TP2_S (30: the TP 2 run; PDSIM_GPU_TP2_RUN_S, 25, its own timeout),
#      PDSIM_GPU_LAYERWISE_S (100),
#      PDSIM_GPU_FIDELITY_S (60), PDSIM_GPU_BENCH_RESERVE_S (90),
#      PDSIM_NCCL_DIR / PDSIM_CUDA_DRIVER_DIR / PDSIM_CUBLAS_DIR (a folder to try first; "none":
#      do not search),
#      PDSIM_GPU_BENCH_ARGS (extra bench transfer arguments, e.g. "--sizes 1M,64M --reps 3"),
#      PDSIM_GPU_ATTN_ARGS (extra bench attention arguments, e.g. "--reps 50 --layers 8"),
#      PDSIM_GPU_MPIRUN (the launcher as shell words; default: the bundle's Open MPI when the
#      binaries are the bundle's, else mpirun on PATH),
#      and the PDSIM_GPU_TWO_PROCESS_* / PDSIM_GPU_LAYERWISE_* / PDSIM_GPU_FIDELITY_* settings of
#      those three scripts.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT_DIR=${OUT:-out}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
MODE=${PDSIM_GPU_MODE:-auto}
BUILD_DIR=${PDSIM_GPU_BUILD_DIR:-build/gpu}
BUDGET=${PDSIM_GPU_CHECK_BUDGET_S:-450}
BENCH_RESERVE=${PDSIM_GPU_BENCH_RESERVE_S:-90}
LW_S=${PDSIM_GPU_LAYERWISE_S:-100}
FID_S=${PDSIM_GPU_FIDELITY_S:-60}
TP_S=${PDSIM_GPU_TWO_PROCESS_S:-40}
TP2_S=${PDSIM_GPU_TP2_S:-30}
START=$SECONDS
ENV_TXT=$OUT_DIR/env.txt
TESTS_LOG=$OUT_DIR/tests.log
BENCH_LOG=$OUT_DIR/bench.log
BENCH_JSON=$OUT_DIR/bench_cuda_ipc.json
ATTN_JSON=$OUT_DIR/bench_attention_cuda.json
SUMMARY=$OUT_DIR/summary.md
LW_DIR=$OUT_DIR/layerwise
FID_DIR=$OUT_DIR/fidelity
TP_DIR=$OUT_DIR/two_process
TP2_DIR=$OUT_DIR/two_process_tp2
rm -f "$ENV_TXT" "$TESTS_LOG" "$BENCH_LOG" "$BENCH_JSON" "$ATTN_JSON" "$SUMMARY" "$OUT_DIR/build.log" \
  "$OUT_DIR/layerwise.log" "$OUT_DIR/fidelity.log" "$OUT_DIR/two_process.log" \
  "$OUT_DIR/two_process_tp2.log"
rm -rf "$LW_DIR" "$FID_DIR" "$TP_DIR" "$TP2_DIR"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 GTEST_COLOR=no
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/pdsim-gpu-check.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT

say() { echo "$*" | tee -a "$ENV_TXT"; }
left() { echo $((BUDGET - (SECONDS - START))); }
# to <seconds> cmd...: runs cmd with a timeout of min(seconds, budget left); 124 when out of time.
to() {
  local want=$1 l
  shift
  l=$(left)
  [ "$l" -lt "$want" ] && want=$l
  if [ "$want" -lt 2 ]; then
    echo "(not run: the check's time budget is spent)"
    return 124
  fi
  timeout -k 5 "$want" "$@"
}
# to_leaving <reserve> <seconds> cmd...: `to`, but leaving <reserve> seconds of the budget to the
# steps after this one.
to_leaving() {
  local reserve=$1 want=$2 l
  shift 2
  l=$(( $(left) - reserve ))
  [ "$l" -lt "$want" ] && want=$l
  if [ "$want" -lt 2 ]; then
    echo "(not run: this step's share of the time budget is spent)"
    return 124
  fi
  timeout -k 5 "$want" "$@"
}
# to_tests <seconds> cmd...: leaves the two-process run, the layerwise and fidelity pairs and the
# benches their time.
to_tests() { to_leaving $((TP_S + TP2_S + LW_S + FID_S + BENCH_RESERVE)) "$@"; }

# ---- the GPU and its driver ----
gpu="nvidia-smi not found"
driver="?"
if command -v nvidia-smi >/dev/null; then
  if q=$(to 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1) \
    && [ -n "$q" ]; then
    gpu=$(head -1 <<<"$q" | awk -F', ' '{print $1 ", " $2}')
    driver=$(head -1 <<<"$q" | awk -F', ' '{print $3}')
  else
    gpu="nvidia-smi failed: $(head -1 <<<"$q")"
  fi
  to 20 nvidia-smi >>"$ENV_TXT" 2>&1
fi
say "== GPU: $gpu; driver: $driver"

ldconfig_p() {
  local lc
  lc=$(command -v ldconfig || echo /sbin/ldconfig)
  [ -x "$lc" ] && to 10 "$lc" -p 2>/dev/null | grep 'x86-64'
}

# ---- libcuda.so.1 (the driver's; never bundled) ----
find_driver_dir() {
  local d
  for d in ${PDSIM_CUDA_DRIVER_DIR:-} \
           $(ldconfig_p | awk '$1 == "libcuda.so.1" {print $NF}' | xargs -r -n1 dirname) \
           /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 \
           /usr/lib/wsl/lib; do
    if [ -e "$d/libcuda.so.1" ]; then echo "$d"; return 0; fi
  done
  return 1
}
DRIVER_DIR=""
[ "${PDSIM_CUDA_DRIVER_DIR:-}" = none ] || DRIVER_DIR=$(find_driver_dir)
if [ -n "$DRIVER_DIR" ]; then say "== libcuda.so.1: $DRIVER_DIR/libcuda.so.1"
else say "== libcuda.so.1: not found (the cuda tests will skip: no device)"; fi

# ---- libnccl.so.2 (pip nvidia-nccl-cu13 first) ----
find_nccl_dir() {
  local d py
  py=$(command -v python3 || true)
  {
    [ -n "${PDSIM_NCCL_DIR:-}" ] && echo "$PDSIM_NCCL_DIR"
    [ -n "${NCCL_HOME:-}" ] && printf '%s\n' "$NCCL_HOME/lib" "$NCCL_HOME/lib64"
    if [ -n "$py" ]; then
      to 20 "$py" - <<'EOF' 2>/dev/null
import os, site, sys
try:
    import nvidia.nccl
    for p in nvidia.nccl.__path__:
        print(os.path.join(p, "lib"))
except Exception:
    pass
dirs = list(sys.path)
try:
    dirs += site.getsitepackages() + [site.getusersitepackages()]
except Exception:
    pass
for p in dirs:
    print(os.path.join(p, "nvidia", "nccl", "lib"))
EOF
    fi
    ldconfig_p | awk '$1 == "libnccl.so.2" {print $NF}' | xargs -r -n1 dirname
    printf '%s\n' /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu
    to 20 find /opt /usr/local /usr/lib /root -maxdepth 8 -name libnccl.so.2 \
      -path '*nvidia/nccl/lib/*' 2>/dev/null | xargs -r -n1 dirname
  } | while read -r d; do
    if [ -n "$d" ] && [ -e "$d/libnccl.so.2" ]; then echo "$d"; break; fi
  done
}
NCCL_DIR=""
[ "${PDSIM_NCCL_DIR:-}" = none ] || NCCL_DIR=$(find_nccl_dir)
if [ -n "$NCCL_DIR" ]; then say "== libnccl.so.2: $NCCL_DIR/libnccl.so.2"
else say "== libnccl.so.2: not found"; fi

# ---- cuBLAS (pip nvidia-cublas first; the bundle leaves it out) ----
# The sonames the bundle's binaries load (.gpu/cublas.txt; empty: none links cuBLAS), else the
# toolkit's libcublasLt.
CUBLAS_LIBS=()
cublas_needed=1
if [ -f .gpu/cublas.txt ]; then
  mapfile -t CUBLAS_LIBS < <(grep -v '^\s*$' .gpu/cublas.txt)
  [ ${#CUBLAS_LIBS[@]} -gt 0 ] || cublas_needed=0
fi
[ ${#CUBLAS_LIBS[@]} -gt 0 ] || CUBLAS_LIBS=(libcublasLt.so.13)
find_cublas_dir() {
  local d py first=${CUBLAS_LIBS[0]}
  py=$(command -v python3 || true)
  {
    [ -n "${PDSIM_CUBLAS_DIR:-}" ] && echo "$PDSIM_CUBLAS_DIR"
    if [ -n "$py" ]; then
      to 20 "$py" - <<'EOF' 2>/dev/null
import importlib, os, site, sys
for mod in ("nvidia.cu13", "nvidia.cublas"):
    try:
        for p in importlib.import_module(mod).__path__:
            print(os.path.join(p, "lib"))
    except Exception:
        pass
dirs = list(sys.path)
try:
    dirs += site.getsitepackages() + [site.getusersitepackages()]
except Exception:
    pass
for p in dirs:
    for sub in ("cu13", "cublas"):
        print(os.path.join(p, "nvidia", sub, "lib"))
EOF
    fi
    ldconfig_p | awk -v n="$first" '$1 == n {print $NF}' | xargs -r -n1 dirname
    for d in /usr/local/cuda /usr/local/cuda-*; do
      printf '%s\n' "$d/lib64" "$d/targets/x86_64-linux/lib"
    done
    echo /usr/lib/x86_64-linux-gnu
    to 20 find /opt /usr/local /usr/lib /root -maxdepth 8 -name "$first" -path '*nvidia/*' \
      2>/dev/null | xargs -r -n1 dirname
  } | while read -r d; do
    [ -n "$d" ] || continue
    local n ok=1
    for n in "${CUBLAS_LIBS[@]}"; do [ -e "$d/$n" ] || ok=0; done
    if [ $ok -eq 1 ]; then echo "$d"; break; fi
  done
}
CUBLAS_DIR=""
[ "${PDSIM_CUBLAS_DIR:-}" = none ] || CUBLAS_DIR=$(find_cublas_dir)
if [ -n "$CUBLAS_DIR" ]; then say "== ${CUBLAS_LIBS[*]}: $CUBLAS_DIR"
else say "== ${CUBLAS_LIBS[*]}: not found (pip install nvidia-cublas; the binaries that link cuBLAS will not load)"; fi

# ---- binaries: build them, or use the bundle ----
BIN_PDSIM=""
TEST_BINS=()
RUN=()
built=0
have_bundle=0
BUNDLE_DIR=""
{ [ -e .gpu/bin/pdsim ] || [ -e .gpu/bin/pdsim.xz ]; } && [ -f .gpu/tests.txt ] && have_bundle=1
if [ "$MODE" = build ] || { [ "$MODE" = auto ] && command -v cmake >/dev/null; }; then
  nccl_args=()
  if [ -n "$NCCL_DIR" ] && [ -e "$NCCL_DIR/../include/nccl.h" ]; then
    nccl_args=(-DNCCL_LIBRARY="$NCCL_DIR/libnccl.so.2" -DNCCL_INCLUDE_DIR="$NCCL_DIR/../include")
  fi
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  say "== configure $BUILD_DIR"
  if to 90 cmake -S . -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DPDSIM_WITH_CUDA=ON \
    -DPDSIM_CUDA_ARCHITECTURES=90 -DPDSIM_BUILD_BENCH=OFF "${nccl_args[@]}" \
    >"$OUT_DIR/build.log" 2>&1; then
    mapfile -t names < <(cd "$BUILD_DIR" && ctest -N -L cuda | sed -n 's/^ *Test *#[0-9]*: //p' | sort -u)
    say "== build: pdsim ${names[*]}"
    if to 180 cmake --build "$BUILD_DIR" -j "$(nproc)" --target pdsim "${names[@]}" \
      >>"$OUT_DIR/build.log" 2>&1; then
      built=1
      BIN_PDSIM=$BUILD_DIR/sim/pdsim
      for n in "${names[@]}"; do TEST_BINS+=("$BUILD_DIR/tests/$n"); done
    else
      say "   build failed or timed out (build.log)"
    fi
  else
    say "   configure failed: $(grep -m1 -iE 'error|could not find|not found' "$OUT_DIR/build.log")"
  fi
fi
if [ $built -eq 1 ]; then
  how="built here ($BUILD_DIR)"
elif [ $have_bundle -eq 1 ] && [ "$MODE" != build ]; then
  # A copy of the bundle in scratch, its *.xz files unpacked (the carried bundle stays as it is);
  # everything below runs from there.
  BUNDLE_DIR=$SCRATCH/gpu
  cp -a .gpu "$BUNDLE_DIR"
  unpack_failed=0
  while IFS= read -r -d '' xzf; do
    if command -v xz >/dev/null; then
      to 120 xz -d "$xzf" || unpack_failed=1
    else
      to 120 python3 -c 'import lzma, os, shutil, sys
src = sys.argv[1]
with lzma.open(src) as i, open(src[:-3], "wb") as o:
    shutil.copyfileobj(i, o)
os.chmod(src[:-3], os.stat(src).st_mode)
os.remove(src)' "$xzf" || unpack_failed=1
    fi
  done < <(find "$BUNDLE_DIR" -type f -name '*.xz' -print0)
  [ $unpack_failed -eq 0 ] || say "   could not unpack every file of the bundle (no xz, no python3?)"
  libdirs=$BUNDLE_DIR/lib
  nccl_path=${NCCL_DIR:-$BUNDLE_DIR/nccl-stub}
  [ -z "$NCCL_DIR" ] && say "   no libnccl.so.2: using the bundle's stub (the nccl transport reports unavailable)"
  [ -z "$CUBLAS_DIR" ] && [ $cublas_needed -eq 1 ] \
    && say "   no ${CUBLAS_LIBS[*]}: the bundle's binaries that link cuBLAS will not load"
  RUN=("$BUNDLE_DIR/lib/ld-linux-x86-64.so.2" --library-path \
       "$libdirs:$nccl_path${CUBLAS_DIR:+:$CUBLAS_DIR}${DRIVER_DIR:+:$DRIVER_DIR}")
  BIN_PDSIM=$BUNDLE_DIR/bin/pdsim
  while read -r n; do [ -n "$n" ] && TEST_BINS+=("$BUNDLE_DIR/bin/$n"); done <.gpu/tests.txt
  how="bundle .gpu ($(sed -n 's/^source: //p' .gpu/MANIFEST.txt 2>/dev/null), via its loader)"
  sed 's/^/   /' .gpu/MANIFEST.txt >>"$ENV_TXT" 2>/dev/null
else
  how="none: no build and no .gpu bundle (run scripts/gpu_bundle.sh on a machine with the deps)"
fi
say "== binaries: $how"
[ ${#RUN[@]} -gt 0 ] && say "   launcher: ${RUN[*]}"
if [ -n "$BIN_PDSIM" ]; then
  say "   $(to 20 "${RUN[@]}" "$BIN_PDSIM" --version 2>&1 | head -3)"
  # The command (shell words, the launcher included) the cuda tests that run pdsim use.
  case $BIN_PDSIM in
    /*) printf -v PDSIM_GPU_TEST_PDSIM '%q ' "${RUN[@]}" "$BIN_PDSIM" ;;
    *) printf -v PDSIM_GPU_TEST_PDSIM '%q ' "${RUN[@]}" "$ROOT/$BIN_PDSIM" ;;
  esac
  export PDSIM_GPU_TEST_PDSIM
fi

# The launcher of the two-process run: the bundle's Open MPI (its plugins and help texts found
# through these variables, one node without ssh) when the binaries are the bundle's, else mpirun.
if [ -z "${PDSIM_GPU_MPIRUN:-}" ]; then
  if [ $built -eq 0 ] && [ -n "$BUNDLE_DIR" ] && [ -x "$BUNDLE_DIR/ompi/bin/orterun" ]; then
    printf -v PDSIM_GPU_MPIRUN '%q ' env \
      "OMPI_MCA_mca_base_component_path=$BUNDLE_DIR/ompi/lib/openmpi3" \
      "PMIX_MCA_mca_base_component_path=$BUNDLE_DIR/ompi/pmix" \
      "OPAL_PKGDATADIR=$BUNDLE_DIR/ompi/share" OMPI_MCA_plm=isolated \
      "${RUN[@]}" "$BUNDLE_DIR/ompi/bin/orterun"
  elif command -v mpirun >/dev/null; then
    PDSIM_GPU_MPIRUN=$(command -v mpirun)
  fi
fi
if [ -n "${PDSIM_GPU_MPIRUN:-}" ]; then
  export PDSIM_GPU_MPIRUN
  say "== mpirun: $PDSIM_GPU_MPIRUN"
else
  say "== mpirun: none (no .gpu/ompi in the bundle and no mpirun on PATH)"
fi

# ---- tests ----
count() { sed -n "s/^\[  $1 *\] \([0-9]*\) tests\{0,1\}[,.].*/\1/p" "$2" | tail -1; }
failed=0
rows=()
skips=()
declare -A test_result=()
for bin in "${TEST_BINS[@]}"; do
  name=$(basename "$bin")
  log=$SCRATCH/$name.log
  echo "== $name"
  to_tests 120 "${RUN[@]}" "$bin" --gtest_color=no >"$log" 2>&1
  rc=$?
  { echo "===== $name (exit $rc)"; cat "$log"; echo; } >>"$TESTS_LOG"
  ran=$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$log" | tail -1)
  p=$(count PASSED "$log")
  s=$(count SKIPPED "$log")
  f=$(count FAILED "$log")
  [ -z "$ran" ] || [ $rc -ne 0 ] || [ "${f:-0}" -ne 0 ] && failed=1
  if [ -z "$ran" ]; then
    case $rc in
      124|137) r="TIMED OUT" ;;
      *) r="did not run (exit $rc): $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-120)" ;;
    esac
  else
    r="${p:-0} passed, ${f:-0} failed, ${s:-0} skipped$([ $rc -ne 0 ] && echo " (exit $rc)")"
  fi
  rows+=("| $name | $r |")
  test_result[$name]=$r
  echo "   $r"
  # "file:line: Skipped" is followed by the reason, then "[  SKIPPED ] Suite.Test (N ms)".
  while IFS= read -r line; do skips+=("$line"); done < <(awk '
    /: Skipped$/ { getline reason; next_reason = reason; have = 1; next }
    have && /^\[  SKIPPED \] [A-Za-z_]/ { sub(/ \([0-9]+ ms\)$/, "", $0); sub(/^\[  SKIPPED \] /, "", $0);
                                          print "| skip | " $0 ": " next_reason " |"; have = 0 }' "$log")
done
if [ ${#TEST_BINS[@]} -eq 0 ]; then rows+=("| tests | not run: no binaries |"); failed=1; fi

# ---- the layerwise pair and the fidelity pair ----
# run_pair <script> <log> <reserve> <seconds> [VAR=value...]: runs scripts/<script> (its pdsim:
# $PDSIM_GPU_TEST_PDSIM) with those settings, leaving <reserve> seconds of the budget; its output
# goes to <log> and here. Sets $pair to ok, "no device: ..." (not a failure), TIMED OUT or
# "exit N: <its message>".
run_pair() {
  local script=$1 log=$2 reserve=$3 secs=$4 rc
  shift 4
  echo "== $script" | tee "$log"
  to_leaving "$reserve" "$secs" env "$@" bash "scripts/$script" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    pair=ok
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    pair="TIMED OUT"
    failed=1
  elif grep -q "no device" "$log"; then
    pair="no device (exit $rc): $(grep -m1 -o 'no device.*' "$log" | cut -c1-160)"
  else
    pair="exit $rc: $(grep -m1 "^$script: " "$log" | cut -c1-160)"
    pair+=" $(grep -m1 -o 'error: .*' "$log" | cut -c1-240)"
    failed=1
  fi
}
lw_pair="not run: no pdsim binary"
fid_pair="not run: no pdsim binary"
tp_run="not run: no pdsim binary"
tp2_run="not run: no pdsim binary"
if [ -n "$BIN_PDSIM" ] && [ -z "${PDSIM_GPU_MPIRUN:-}" ]; then
  tp_run="not run: no mpirun (neither the bundle's .gpu/ompi nor one on PATH)"
  tp2_run=$tp_run
  failed=1
elif [ -n "$BIN_PDSIM" ]; then
  run_pair gpu_two_process.sh "$OUT_DIR/two_process.log" \
    $((TP2_S + LW_S + FID_S + BENCH_RESERVE)) "$TP_S" OUT="$TP_DIR" \
    PDSIM_GPU_TWO_PROCESS_RUN_S="${PDSIM_GPU_TWO_PROCESS_RUN_S:-35}"
  tp_run=$pair
  run_pair gpu_two_process.sh "$OUT_DIR/two_process_tp2.log" $((LW_S + FID_S + BENCH_RESERVE)) \
    "$TP2_S" OUT="$TP2_DIR" PDSIM_GPU_TWO_PROCESS_PREFILL_TP=2 \
    PDSIM_GPU_TWO_PROCESS_RUN_S="${PDSIM_GPU_TP2_RUN_S:-25}"
  tp2_run=$pair
fi
if [ -n "$BIN_PDSIM" ]; then
  run_pair gpu_layerwise.sh "$OUT_DIR/layerwise.log" $((FID_S + BENCH_RESERVE)) "$LW_S" \
    OUT="$LW_DIR" \
    PDSIM_GPU_LAYERWISE_RUN_S="${PDSIM_GPU_LAYERWISE_RUN_S:-40}"
  lw_pair=$pair
  run_pair gpu_fidelity.sh "$OUT_DIR/fidelity.log" "$BENCH_RESERVE" "$FID_S" \
    OUT="$FID_DIR" \
    PDSIM_GPU_FIDELITY_RUN_S="${PDSIM_GPU_FIDELITY_RUN_S:-45}"
  fid_pair=$pair
fi

# ---- benchmarks ----
# run_bench <json> <seconds> args...: runs pdsim with args, appending its output to bench.log;
# sets $bench to ok, "no device (exit 1): ..." (not a failure), TIMED OUT or "exit N: <last line>".
run_bench() {
  local json=$1 secs=$2 log=$SCRATCH/bench.out rc
  shift 2
  echo "== pdsim $*" | tee -a "$BENCH_LOG"
  to "$secs" "${RUN[@]}" "$BIN_PDSIM" "$@" >"$log" 2>&1
  rc=$?
  tee -a "$BENCH_LOG" <"$log"
  if [ $rc -eq 0 ] && [ -s "$json" ]; then
    bench="ok"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    bench="TIMED OUT"
    failed=1
  elif [ $rc -eq 1 ] && grep -q "no device" "$log"; then
    bench="no device (exit 1): $(grep -m1 -o 'no device.*' "$log" | cut -c1-160)"
  else
    bench="exit $rc: $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-200)"
    failed=1
  fi
}
# cuda_ipc vs raw cudaMemcpyAsync: this is the measurement of the transport's completion poller.
bench="not run: no pdsim binary"
if [ -n "$BIN_PDSIM" ]; then
  # shellcheck disable=SC2086
  run_bench "$BENCH_JSON" 100 bench transfer --transport cuda_ipc --json "$BENCH_JSON" \
    ${PDSIM_GPU_BENCH_ARGS:-}
fi
bench_ipc=$bench
# The cuda attention backend and the GPU model (llama3-8b shapes, one GPU).
bench="not run: no pdsim binary"
if [ -n "$BIN_PDSIM" ]; then
  # shellcheck disable=SC2086
  run_bench "$ATTN_JSON" 120 bench attention --backend cuda --json "$ATTN_JSON" \
    ${PDSIM_GPU_ATTN_ARGS:-}
fi
bench_attn=$bench

# ---- the table ----
{
  echo "## pdsim GPU check"
  echo
  echo "| item | result |"
  echo "|---|---|"
  echo "| GPU | $gpu |"
  echo "| driver | $driver |"
  echo "| binaries | $how |"
  echo "| libcuda.so.1 | ${DRIVER_DIR:-not found} |"
  echo "| libnccl.so.2 | ${NCCL_DIR:-not found (stub)} |"
  if [ $built -eq 1 ]; then
    cublas_row="${CUBLAS_DIR:-not found} (unused: binaries built here load the toolkit's, by RPATH)"
  elif [ -n "$CUBLAS_DIR" ]; then
    cublas_row=$CUBLAS_DIR
  elif [ $cublas_needed -eq 0 ]; then
    cublas_row="not found (not needed: no bundled binary links cuBLAS)"
  else
    cublas_row="NOT FOUND: the binaries that link cuBLAS cannot load (pip install nvidia-cublas, or set PDSIM_CUBLAS_DIR)"
  fi
  echo "| ${CUBLAS_LIBS[*]} | $cublas_row |"
  printf '%s\n' "${rows[@]}"
  [ ${#skips[@]} -gt 0 ] && printf '%s\n' "${skips[@]}"
  # The testbed 1P1D on one GPU in --mode both, and the faulted runs: the cuda tests run them.
  echo "| testbed 1P1D on one GPU, --mode both (gpu-1p1d, tiny and llama3-8b --layers 2) |" \
    "testbed_gpu_disagg_test: ${test_result[testbed_gpu_disagg_test]:-not run} |"
  echo "| faulted runs (every --fault kind on gpu-1p1d) |" \
    "testbed_gpu_fault_test: ${test_result[testbed_gpu_fault_test]:-not run} |"
  if [ "$tp_run" = ok ] && [ -s "$TP_DIR/two_process.md" ]; then
    cat "$TP_DIR/two_process.md"
  else
    echo "| testbed 1P1D, two processes on one GPU (mpirun, gpu-1p1d; gpu_two_process.sh) |" \
      "$tp_run$([ -s "$TP_DIR/two_process.json" ] && echo ": $(python3 -c 'import json, sys
print(json.load(open(sys.argv[1]))["summary"])' "$TP_DIR/two_process.json" 2>/dev/null)") |"
  fi
  if [ "$tp2_run" = ok ] && [ -s "$TP2_DIR/two_process.md" ]; then
    cat "$TP2_DIR/two_process.md"
  else
    echo "| testbed TP 2 prefill -> TP 1 decode, three processes on one GPU (mpirun," \
      "gpu-1p1d-tp2-to-tp1; gpu_two_process.sh) |" \
      "$tp2_run$([ -s "$TP2_DIR/two_process.json" ] && echo ": $(python3 -c 'import json, sys
print(json.load(open(sys.argv[1]))["summary"])' "$TP2_DIR/two_process.json" 2>/dev/null)") |"
  fi
  echo "| layerwise pair (gpu_layerwise.sh) | $lw_pair |"
  if [ -s "$LW_DIR/layerwise.json" ] && command -v python3 >/dev/null; then
    python3 - "$LW_DIR/layerwise.json" <<'EOF' || echo "| layerwise | (could not read $LW_DIR/layerwise.json) |"
import json, math, sys
j = json.load(open(sys.argv[1]))
r, t, eq = j["rows"], j["targets"], j["equal_rate"]
num = lambda x: isinstance(x, (int, float)) and math.isfinite(x)
f = lambda x, spec: format(x, spec) if num(x) else "-"
pf = lambda b: "PASS" if b else "FAIL"
for off, on in ((r[0], r[1]), (r[2], r[3])):
    if on is r[1]:
        what = f"layerwise at {on['gbps']:.4g} GB/s"
    else:
        what = (f"layerwise at transfer == prefill ({eq['gbps']:.4g} GB/s = "
                f"{eq['kv_bytes_per_prompt'] / 2**20:.1f} MiB / {eq['prefill_ms']:.1f} ms)")
    red = on.get("ttft_reduction_vs_off")
    cell = (f"TTFT p50 on {f(on['ttft_p50_ms'], '.1f')} ms, off {f(off['ttft_p50_ms'], '.1f')} "
            f"ms: {'-' if not num(red) else format(-red, '+.1%')}")
    if "reduction_target_met" in on:
        cell += (f" (reduction >= {t['ttft_reduction_min_at_equal_rate']:.0%} "
                 f"{pf(on['reduction_target_met'])}; SGLang 48-68% at 1k-8k tokens)")
    cell += (f"; exposed fraction on {f(on['exposed_fraction'], '.3f')} (<= "
             f"{t['exposed_fraction_max']:.2f} {pf(on['exposed_target_met'])}), off "
             f"{f(off['exposed_fraction'], '.3f')}; per-layer latency p50 on "
             f"{f(on['layer_latency_p50_us'], '.0f')} us, off "
             f"{f(off['layer_latency_p50_us'], '.0f')} us")
    print(f"| {what} | {cell} |")
EOF
  fi
  echo "| fidelity pair (gpu_fidelity.sh) | $fid_pair |"
  if [ -s "$FID_DIR/fidelity.json" ] && command -v python3 >/dev/null; then
    python3 - "$FID_DIR/fidelity.json" <<'EOF' || echo "| fidelity | (could not read $FID_DIR/fidelity.json) |"
import json, sys
j = json.load(open(sys.argv[1]))
for r in j["rows"]:
    if r.get("simulator_p50_ms") is None:
        print(f"| fidelity {r['metric']} p50 | no simulator figure: FAIL |")
        continue
    print(f"| fidelity {r['metric']} p50 (simulator / GPU testbed) | {r['simulator_p50_ms']:.2f} / "
          f"{r['testbed_p50_ms']:.2f} ms = {r['ratio']:.3f} (within "
          f"{j['target_within']:.0%} {'PASS' if r['within_target'] else 'FAIL'}) |")
EOF
  fi
  echo "| bench transfer cuda_ipc | $bench_ipc |"
  # That bench is the measurement of the cuda_ipc completion poller (spin for 200 us, then sleep):
  # its 1 and 4 MiB rows were 0.889x and 0.807x before it (H200, docs/gpu-results.md 2026-11-30).
  if [ "$bench_ipc" = ok ] && command -v python3 >/dev/null; then
    python3 - "$BENCH_JSON" <<'EOF' || echo "| cuda_ipc poller | (could not read $BENCH_JSON) |"
import json, sys
j = json.load(open(sys.argv[1]))
t = j.get("target_ratio", 0.9)
by = {r["bytes"]: r["ratio"] for r in j["rows"]}
got = [f"{b >> 20} MiB {by[b]:.3f}x {'meets' if by[b] >= t else 'BELOW'} {t:.2f}"
       for b in (1 << 20, 4 << 20) if b in by]
print("| cuda_ipc poller (spin, then sleep): the cuda_ipc table below | "
      + ("; ".join(got) if got else "no 1 or 4 MiB rows")
      + " (before the change: 0.889x, 0.807x) |")
EOF
  elif [[ $bench_ipc == "no device"* ]]; then
    echo "| cuda_ipc poller (spin, then sleep): the cuda_ipc table below | not measured: no device |"
  else
    echo "| cuda_ipc poller (spin, then sleep): the cuda_ipc table below | not measured |"
  fi
  echo "| bench attention cuda | $bench_attn |"
  echo "| wall | $((SECONDS - START)) s |"
  if [ "$bench_attn" = ok ] && command -v python3 >/dev/null; then
    echo
    python3 - "$ATTN_JSON" <<'EOF' || echo "(could not read $ATTN_JSON)"
import json, sys
j = json.load(open(sys.argv[1]))
d, e, m, dev = j["decode"], j["extend"], j["model"], j["device"]
print(f"bench attention --backend cuda on {dev['name']}: bf16 KV, {j['num_q_heads']}q/"
      f"{j['num_kv_heads']}kv heads x {j['head_dim']}, page {j['page_size']}; median of "
      f"{j['reps']} rounds; outputs finite and within the fp64 oracle's tolerance "
      f"(max abs error decode {d['max_abs_error']:.2g}, extend {e['max_abs_error']:.2g})")
print()
print("| figure | measured | baseline | ratio | target |")
print("|---|---|---|---|---|")
def target(r, t):
    return f"{t:.2f} {'PASS' if r >= t else 'BELOW'}"
print(f"| decode {d['batch']}x{d['kv_len']} KV tokens | {d['gbps']:.0f} GB/s | "
      f"{d['baseline_gbps']:.0f} GB/s (device-to-device copy, read + write) | "
      f"{d['ratio']:.3f} | {target(d['ratio'], d['target'])} |")
print(f"| extend {e['batch']}x{e['q_len']} causal | {e['gflops'] / 1e3:.1f} TFLOP/s | "
      f"{e['baseline_gflops'] / 1e3:.1f} TFLOP/s (cuBLASLt bf16 GEMM {e['baseline_m']}x"
      f"{e['baseline_n']}x{e['baseline_k']}) | {e['ratio']:.3f} | "
      f"{target(e['ratio'], e['target'])} |")
for phase in ("prefill", "decode"):
    p = m[phase]
    what = (f"prefill {p['tokens']} tokens" if phase == "prefill"
            else f"decode {p['batch']}x{p['kv_len']}")
    if p["ratio"] is None:
        base, ratio = m["roofline_note"], "-"
    else:
        base = (f"{p['roofline_per_layer_ms']:.3f} ms ({m['roofline']}; at peak "
                f"{p['roofline_peak_per_layer_ms']:.3f} ms)")
        ratio = f"{p['ratio']:.2f}"
    print(f"| {m['name']} {what}, per layer ({m['layers']} layers) | "
          f"{p['per_layer_ms']:.3f} ms | {base} | {ratio} | - (measured / roofline) |")
EOF
  fi
  for md in "$LW_DIR/layerwise.md" "$FID_DIR/fidelity.md"; do
    if [ -s "$md" ]; then echo; cat "$md"; fi
  done
  if [ "$bench_ipc" = ok ] && command -v python3 >/dev/null; then
    echo
    python3 - "$BENCH_JSON" <<'EOF' || echo "(could not read $BENCH_JSON)"
import json, sys
j = json.load(open(sys.argv[1]))
target, floor = j.get("target_ratio", 0), j.get("target_min_bytes", 0)
print(f"cuda_ipc vs {j.get('baseline', 'baseline')}; target {target:.2f}x at >= {floor >> 20} MiB"
      " (the measurement of the completion poller: spin, then sleep)")
print()
print("| size | GB/s | baseline GB/s | ratio | meets target |")
print("|---|---|---|---|---|")
for r in j["rows"]:
    b = r["bytes"]
    size = f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
    meets = "-" if b < floor or not target else ("yes" if r["ratio"] >= target else "NO")
    print(f"| {size} | {r['gbps']:.1f} | {r['baseline_gbps']:.1f} | {r['ratio']:.3f} | {meets} |")
EOF
  fi
} >"$SUMMARY"
echo
cat "$SUMMARY"
# 0: everything ran and nothing failed (skips and "no device" included); 1 otherwise.
exit $failed
