#!/usr/bin/env bash
# Builds what the GPU check needs (the tests labelled `cuda` and pdsim, with CUDA and NCCL, for
# sm_90) and packs them, with every shared library they load, into a self-contained bundle at
# .gpu/ for a bare GPU machine (no MPI, Boost, yaml-cpp, spdlog, GTest, OpenBLAS there). Carry
# .gpu/ with the tree and run scripts/gpu_check.sh there (docs/gpu-results.md).
#
#   .gpu/bin/        the binaries, stripped
#   .gpu/lib/        their libraries from this machine, glibc's loader and libc included, so they
#                    run on any glibc when started as
#                    <bundle>/lib/ld-linux-x86-64.so.2 --library-path <bundle>/lib:<nccl>:<driver> BIN
#   Every file over 64 KiB is stored xz-compressed (*.xz): a device call carries the working tree
#   and the bundle, 64 MiB in all (docs/gpu-results.md), and the bundle is about 120 MiB unpacked,
#   32 MiB packed. gpu_check.sh unpacks a copy into its scratch folder (xz, else Python's lzma) and
#   runs that. This script fails when the tree and the bundle together exceed the limit.
#   .gpu/nccl-stub/  a stand-in libnccl.so.2 for a machine that has none (scripts/nccl_stub.cpp)
#   .gpu/share/pdsim/topologies/  the example topologies (topology/examples), where the binaries
#                    look for shipped data next to themselves (common/data_dir.h: <dir of the
#                    binary>/../share/pdsim): testbed_gpu_test runs `pdsim testbed --topology
#                    gpu-1c`, testbed_gpu_disagg_test and testbed_gpu_fault_test gpu-1p1d,
#                    gpu-2g-1p1d and gpu-1p1d-tp2-to-tp1, and they resolve the same names
#                    in-process
#   .gpu/ompi/       Open MPI's launcher from this machine (bin/orterun, its plugins in
#                    lib/openmpi3, PMIx's in pmix, help texts in share; libraries in .gpu/lib)
#                    for scripts/gpu_two_process.sh: two processes on one GPU under mpirun, on a
#                    machine without MPI. Started through the bundled loader with
#                    OMPI_MCA_mca_base_component_path=.gpu/ompi/lib/openmpi3,
#                    PMIX_MCA_mca_base_component_path=.gpu/ompi/pmix, OPAL_PKGDATADIR=.gpu/ompi/share
#                    and OMPI_MCA_plm=isolated (one node: no ssh), as scripts/gpu_check.sh does.
#                    Fabric plugins (UCX, libfabric, PSM, verbs) and batch-system ones are left out.
#   .gpu/tests.txt   the cuda test binaries; .gpu/MANIFEST.txt what was built from what
#   .gpu/cublas.txt  the cuBLAS libraries the binaries load and the bundle leaves out (sonames)
# Left out on purpose: the driver (libcuda.so.1, libnvidia-*: must be the GPU machine's),
# libnccl.so.2 (over 200 MiB: the GPU machine's pip package nvidia-nccl-cu13 provides it) and
# cuBLAS (libcublas*.so*, about 600 MiB: pip's nvidia-cublas there; gpu_check.sh finds it). pdsim
# itself links cuBLASLt when built with FlashInfer (`bench attention --backend cuda`: the GEMM
# baseline and the GPU model), so it needs that cuBLAS too. FlashInfer is header-only: compiled
# into the binaries, nothing to bundle.
#
# Then it checks the bundle here: every binary, run through the bundled loader inside a chroot that
# holds nothing but the bundle (no /lib, no /usr), must load; both GPU benches must exit 1 with
# "no device"; the cuda tests must pass or skip (no GPU here: they skip) with the real NCCL and with
# the stub, and with this machine's cuBLAS in its own folder of the chroot (as the GPU machine's
# comes from outside the bundle); the bundled mpirun must start two pdsim testbed processes
# (cpu-1p1d, --mode both) that complete every request. Skip that with PDSIM_BUNDLE_VERIFY=0.
#
# Env: PDSIM_JOBS (default 2), CUDA_HOME (default /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/gpu-bundle
BUNDLE=.gpu
JOBS=${PDSIM_JOBS:-2}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
carry_limit=$((64 << 20))  # what one device call carries: the working tree and this bundle

echo "== configure ($BUILD)"
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPDSIM_WITH_CUDA=ON \
  -DPDSIM_WITH_NCCL=ON -DPDSIM_CUDA_ARCHITECTURES=90 -DPDSIM_BUILD_BENCH=OFF \
  >"$BUILD/configure.log" 2>&1 || { cat "$BUILD/configure.log"; exit 1; }
sed -n '/pdsim .* configuration/,/^-- $/p' "$BUILD/configure.log"

mapfile -t tests < <(cd "$BUILD" && ctest -N -L cuda | sed -n 's/^ *Test *#[0-9]*: //p' | sort -u)
[ ${#tests[@]} -gt 0 ] || { echo "no tests labelled cuda" >&2; exit 1; }
echo "== build (-j$JOBS): pdsim ${tests[*]}"
cmake --build "$BUILD" -j "$JOBS" --target pdsim "${tests[@]}"

echo "== pack $BUNDLE"
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib" "$BUNDLE/nccl-stub" "$BUNDLE/share/pdsim/topologies"
install -m 644 topology/examples/*.yaml "$BUNDLE/share/pdsim/topologies/"
for t in gpu-1c gpu-1p1d gpu-2g-1p1d gpu-1p1d-tp2-to-tp1 gpu-2g-1p1d-tp2-to-tp1; do
  [ -f "$BUNDLE/share/pdsim/topologies/$t.yaml" ] || { echo "no topology/examples/$t.yaml" >&2; exit 1; }
done
bins=("$BUILD/sim/pdsim")
for t in "${tests[@]}"; do bins+=("$BUILD/tests/$t"); done
printf '%s\n' "${tests[@]}" >"$BUNDLE/tests.txt"

declare -A libs=()
declare -A cublas_libs=()  # left out of the bundle: name -> path on this machine
loader=""
# add_libs <elf>: the libraries it loads into libs (and the ELF loader into loader); 1, adding
# nothing, when one is not found (ldd's line goes to $missing).
missing=""
add_libs() {
  local line name path
  missing=$(ldd "$1" | grep "not found" || true)
  [ -z "$missing" ] || return 1
  while read -r line; do
    case "$line" in
      linux-vdso*) ;;
      *" => "/*) name=${line%% =>*}; path=${line#* => }; path=${path%% (*}; libs[$name]=$path ;;
      /*ld-linux*) loader=${line%% (*} ;;
    esac
  done < <(ldd "$1")
}
for b in "${bins[@]}"; do
  install -m 755 "$b" "$BUNDLE/bin/"
  strip --strip-all "$BUNDLE/bin/$(basename "$b")"
  add_libs "$b" || { echo "$b: $missing" >&2; exit 1; }
done
[ -n "$loader" ] || { echo "no ELF loader found by ldd" >&2; exit 1; }

# Open MPI's launcher (orterun) and the plugins it and the ranks load; their libraries join libs.
ompi_plugins=0
orterun=$(readlink -f "$(command -v mpirun || true)" 2>/dev/null || true)
pkglibdir=$(ompi_info --path pkglibdir 2>/dev/null | sed -n 's/.*Pkglibdir: *//p')
pkgdatadir=$(ompi_info --path pkgdatadir 2>/dev/null | sed -n 's/.*Pkgdatadir: *//p')
ompi_version=$(ompi_info --version 2>/dev/null | head -1)
if [ -x "$orterun" ] && [ -d "$pkglibdir" ]; then
  mkdir -p "$BUNDLE/ompi/bin" "$BUNDLE/ompi/lib/openmpi3" "$BUNDLE/ompi/pmix" "$BUNDLE/ompi/share"
  install -m 755 "$orterun" "$BUNDLE/ompi/bin/orterun"
  if [ -d "$pkgdatadir" ]; then cp -r "$pkgdatadir/." "$BUNDLE/ompi/share/"; fi
  ompi_skip='ucx|ofi|psm|openib|verbs|usnic|java|slurm|flux|jsm|gridengine|monitoring|treematch'
  pmix_dir=""
  add_libs "$orterun" || { echo "$orterun: $missing" >&2; exit 1; }
  for f in "$pkglibdir"/*.so; do
    grep -Eq "$ompi_skip" <<<"$(basename "$f")" && continue
    if add_libs "$f"; then
      install -m 755 "$f" "$BUNDLE/ompi/lib/openmpi3/"
      ompi_plugins=$((ompi_plugins + 1))
    fi
    [ -n "$pmix_dir" ] || pmix_dir=$(ldd "$f" | sed -n 's/.*libpmix.so.2 => \([^ ]*\).*/\1/p')
  done
  if [ -n "$pmix_dir" ]; then
    pmix_dir=$(dirname "$(readlink -f "$pmix_dir")")/pmix
    for f in "$pmix_dir"/*.so; do
      if [ -e "$f" ] && add_libs "$f"; then install -m 755 "$f" "$BUNDLE/ompi/pmix/"; fi
    done
  fi
  echo "mpirun: $orterun ($ompi_version), $ompi_plugins plugins"
else
  echo "no Open MPI here (mpirun, ompi_info): the bundle has no mpirun, and the GPU check's" \
    "two-process row will say so" >&2
fi
cp -L "$loader" "$BUNDLE/lib/ld-linux-x86-64.so.2"
# glibc 2.34+ has NSS files/dns inside libc; these stubs keep an older-style lookup from failing.
libdir=$(dirname "${libs[libc.so.6]}")
for n in libnss_files.so.2 libnss_dns.so.2; do
  if [ -e "$libdir/$n" ]; then libs[$n]=$libdir/$n; fi
done
for name in "${!libs[@]}"; do
  case "$name" in
    libcuda.so*|libnvidia-*|libnccl.so*) continue ;;
    libcublas*.so*) cublas_libs[$name]=${libs[$name]}; continue ;;
  esac
  cp -L "${libs[$name]}" "$BUNDLE/lib/$name"
done

c++ -shared -fPIC -O2 -std=c++17 -I"$CUDA_HOME/include" -Wl,--as-needed \
  -Wl,-soname,libnccl.so.2 -o "$BUNDLE/nccl-stub/libnccl.so.2" scripts/nccl_stub.cpp
strip --strip-unneeded "$BUNDLE/nccl-stub/libnccl.so.2"
for name in "${!cublas_libs[@]}"; do echo "$name"; done | sort >"$BUNDLE/cublas.txt"

echo "== compress (xz -9, files over 64 KiB)"
unpacked=$(du -sb "$BUNDLE" | cut -f1)
find "$BUNDLE" -type f -size +64k -print0 | xargs -0 -r xz -9 -T"$JOBS"
bundle_bytes=$(du -sb "$BUNDLE" | cut -f1)
# The rest of what a device call carries: tracked files and untracked ones git does not ignore.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null \
               | awk '$2 == "total" { s += $1 } END { print s + 0 }')
echo "bundle: $((unpacked >> 20)) MiB unpacked, $((bundle_bytes >> 20)) MiB packed; with the" \
  "working tree ($((tree_bytes >> 20)) MiB) a device call carries" \
  "$(((bundle_bytes + tree_bytes) >> 20)) MiB of its 64 MiB"
if [ $((bundle_bytes + tree_bytes)) -gt $carry_limit ]; then
  echo "the working tree and the bundle exceed the 64 MiB a device call carries; leave files out" \
    "of the bundle or the tree" >&2
  exit 1
fi

{
  echo "pdsim GPU bundle"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version | head -1)"
  echo "source: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- 2>/dev/null || echo ' + local changes')"
  echo "cuda: $("$CUDA_HOME/bin/nvcc" --version | tail -1); archs: 90"
  grep -E "^-- +(CUDA|NCCL) +:" "$BUILD/configure.log" | sed 's/^-- *//'
  echo "tests: ${tests[*]}"
  if [ -x "$BUNDLE/ompi/bin/orterun" ]; then
    echo "mpirun: ompi/bin/orterun, $ompi_version, $ompi_plugins plugins"
  else
    echo "mpirun: none"
  fi
  echo "left out, from the GPU machine: libcuda.so.1, libnccl.so.2$(sed 's/^/, /' "$BUNDLE/cublas.txt" | tr -d '\n')"
  echo "stored: files over 64 KiB xz-compressed (*.xz); $((unpacked >> 20)) MiB unpacked, $((bundle_bytes >> 20)) MiB packed"
  echo "files:"
  (cd "$BUNDLE" && find . -type f ! -name MANIFEST.txt -printf '  %p %s\n' | sort)
} >"$BUNDLE/MANIFEST.txt"
echo "bundle: $(find "$BUNDLE" -type f | wc -l) files in $BUNDLE"

[ "${PDSIM_BUNDLE_VERIFY:-1}" = "1" ] || exit 0

echo "== verify: each binary in a chroot holding only the bundle"
jail=$(mktemp -d /tmp/pdsim-gpu-jail.XXXXXX)
trap 'rm -rf "$jail"' EXIT
cp -a "$BUNDLE" "$jail/gpu"
mkdir -p "$jail/tmp" "$jail/nccl" "$jail/cublas"
find "$jail/gpu" -type f -name '*.xz' -print0 | xargs -0 -r xz -d -T"$JOBS"
nccl_real=$(ldd "$BUILD/sim/pdsim" | sed -n 's/.*libnccl.so.2 => \([^ ]*\).*/\1/p')
if [ -n "$nccl_real" ]; then cp -L "$nccl_real" "$jail/nccl/libnccl.so.2"; fi
# This machine's cuBLAS stands in for the GPU machine's: a hard link where the jail shares the
# file system (cuBLASLt alone is over 500 MiB), else a copy.
for name in "${!cublas_libs[@]}"; do
  real=$(readlink -f "${cublas_libs[$name]}")
  ln "$real" "$jail/cublas/$name" 2>/dev/null || cp -L "$real" "$jail/cublas/$name"
done
fail=0
jrun() {  # jrun <nccl dir in the jail> <binary> [args...]: run in the jail via the bundled loader
  local nccl=$1; shift
  chroot "$jail" /gpu/lib/ld-linux-x86-64.so.2 --inhibit-cache \
    --library-path "/gpu/lib:$nccl:/cublas" "/gpu/bin/$1" "${@:2}"
}
for nccl in /nccl /gpu/nccl-stub; do
  [ "$nccl" = /nccl ] && [ -z "$nccl_real" ] && continue
  if out=$(jrun "$nccl" pdsim --version 2>&1); then
    echo "ok   pdsim --version ($out) [nccl: $nccl]"
  else
    echo "FAIL pdsim --version: $out"; fail=1
  fi
  rc=0; out=$(jrun "$nccl" pdsim bench transfer --transport cuda_ipc 2>&1) || rc=$?
  if [ $rc -eq 1 ] && grep -q "no device" <<<"$out"; then
    echo "ok   pdsim bench transfer --transport cuda_ipc: exit 1, $(grep -o 'no device.*' <<<"$out")"
  else
    echo "FAIL pdsim bench transfer --transport cuda_ipc: rc=$rc: $out"; fail=1
  fi
  rc=0; out=$(jrun "$nccl" pdsim bench attention --backend cuda 2>&1) || rc=$?
  if [ $rc -eq 1 ] && grep -q "no device" <<<"$out"; then
    echo "ok   pdsim bench attention --backend cuda: exit 1, $(grep -o 'no device.*' <<<"$out")"
  else
    echo "FAIL pdsim bench attention --backend cuda: rc=$rc: $out"; fail=1
  fi
  for t in "${tests[@]}"; do
    rc=0; out=$(jrun "$nccl" "$t" --gtest_color=no 2>&1) || rc=$?
    counts=$(grep -E '^\[  (PASSED|SKIPPED|FAILED)  ?\] [0-9]+ test' <<<"$out" | tr -s ' ' | paste -sd';')
    if [ $rc -eq 0 ] && grep -q '^\[  PASSED  \]' <<<"$out"; then
      echo "ok   $t: $counts"
    else
      echo "FAIL $t (rc=$rc): $out" | tail -20; fail=1
    fi
  done
done
# Two pdsim processes under the bundled mpirun (what scripts/gpu_two_process.sh runs on the GPU
# machine, with CPU ranks here): every request of both runs completes. The jail has no /proc or
# /sys (hwloc says so and carries on), so pdsim cannot find its data folder from /proc/self/exe
# and is given the topology's path.
if [ -x "$jail/gpu/ompi/bin/orterun" ]; then
  rc=0
  out=$(OMPI_MCA_mca_base_component_path=/gpu/ompi/lib/openmpi3 \
        PMIX_MCA_mca_base_component_path=/gpu/ompi/pmix OPAL_PKGDATADIR=/gpu/ompi/share \
        OMPI_MCA_plm=isolated OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        timeout -k 5 120 chroot "$jail" /gpu/lib/ld-linux-x86-64.so.2 --inhibit-cache \
          --library-path /gpu/lib /gpu/ompi/bin/orterun -np 2 --oversubscribe --bind-to none \
          --mca pml ob1 --mca btl self,vader --mca btl_vader_single_copy_mechanism none \
          /gpu/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path "/gpu/lib:/gpu/nccl-stub:/cublas" \
          /gpu/bin/pdsim testbed --topology /gpu/share/pdsim/topologies/cpu-1p1d.yaml \
          --model tiny --synthetic 4 --transport mpi --max-input-len 64 --max-output-len 8 \
          --mode both --report /tmp/two-process.json 2>&1) \
    || rc=$?
  if [ $rc -eq 0 ] && python3 - "$jail/tmp/two-process.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
ok = (r["config"]["ranks"] == 2 and r["config"]["transport"] == "mpi"
      and r["requests_completed"] == 4 == r["colocated"]["requests_completed"]
      and r["outputs_match"] is True and r["ordering"]["violations"] == 0)
sys.exit(0 if ok else 1)
EOF
  then
    echo "ok   mpirun -np 2 pdsim testbed (cpu-1p1d, --mode both) through the bundled Open MPI"
  else
    echo "FAIL mpirun -np 2 pdsim testbed through the bundled Open MPI (rc=$rc): $out" | tail -20
    fail=1
  fi
else
  echo "FAIL the bundle has no mpirun (.gpu/ompi/bin/orterun)"; fail=1
fi
# Outside the jail: which files the loader actually opened must all be the bundle's.
# (cuBLAS comes from the jail's /cublas, the stand-in for the GPU machine's.)
stray=$(LD_DEBUG=libs "$jail/gpu/lib/ld-linux-x86-64.so.2" --inhibit-cache \
          --library-path "$jail/gpu/lib:$jail/gpu/nccl-stub:$jail/cublas" \
          "$jail/gpu/bin/${tests[0]}" --gtest_list_tests 2>&1 >/dev/null \
          | sed -n 's/.*calling init: //p' | grep -v -e "^$jail/gpu/" -e "^$jail/cublas/" || true)
if [ -n "$stray" ]; then echo "FAIL loaded from outside the bundle: $stray"; fail=1
else echo "ok   LD_DEBUG: every library ${tests[0]} loads comes from the bundle (cuBLAS: its stand-in)"; fi
if [ $fail -ne 0 ]; then echo "== bundle verification FAILED"; exit 1; fi
echo "== bundle verified"
