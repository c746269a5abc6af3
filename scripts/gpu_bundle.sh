#!/usr/bin/env bash
# Builds what the GPU check needs (the tests labelled `cuda` and pdsim, with CUDA and NCCL, for
# sm_90) and packs them, with every shared library they load, into a self-contained bundle at
# .gpu/ for a bare GPU machine (no MPI, Boost, yaml-cpp, spdlog, GTest, OpenBLAS there). Carry
# .gpu/ with the tree and run scripts/gpu_check.sh there (docs/gpu-results.md).
#
#   .gpu/bin/        the binaries, stripped
#   .gpu/lib/        their libraries from this machine, glibc's loader and libc included, so they
#                    run on any glibc when started as
#                    .gpu/lib/ld-linux-x86-64.so.2 --library-path .gpu/lib:<nccl dir>:<driver dir> BIN
#                    Libraries above 8 MiB are stored gzip'd (*.gz); gpu_check.sh unpacks them.
#   .gpu/nccl-stub/  a stand-in libnccl.so.2 for a machine that has none (scripts/nccl_stub.cpp)
#   .gpu/share/pdsim/topologies/  the example topologies (topology/examples), where the binaries
#                    look for shipped data next to themselves (common/data_dir.h: <dir of the
#                    binary>/../share/pdsim): testbed_gpu_test runs `pdsim testbed --topology
#                    gpu-1c`, testbed_gpu_disagg_test and testbed_gpu_fault_test gpu-1p1d and
#                    gpu-2g-1p1d, and they resolve the same names in-process
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
# comes from outside the bundle). Skip that with PDSIM_BUNDLE_VERIFY=0.
#
# Env: PDSIM_JOBS (default 2), CUDA_HOME (default /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/gpu-bundle
BUNDLE=.gpu
JOBS=${PDSIM_JOBS:-2}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
big=$((8 << 20))

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
for t in gpu-1c gpu-1p1d gpu-2g-1p1d; do
  [ -f "$BUNDLE/share/pdsim/topologies/$t.yaml" ] || { echo "no topology/examples/$t.yaml" >&2; exit 1; }
done
bins=("$BUILD/sim/pdsim")
for t in "${tests[@]}"; do bins+=("$BUILD/tests/$t"); done
printf '%s\n' "${tests[@]}" >"$BUNDLE/tests.txt"

declare -A libs=()
declare -A cublas_libs=()  # left out of the bundle: name -> path on this machine
loader=""
for b in "${bins[@]}"; do
  install -m 755 "$b" "$BUNDLE/bin/"
  strip --strip-all "$BUNDLE/bin/$(basename "$b")"
  while read -r line; do
    case "$line" in
      *"not found"*) echo "$b: $line" >&2; exit 1 ;;
      linux-vdso*) ;;
      *" => "/*) name=${line%% =>*}; path=${line#* => }; path=${path%% (*}; libs[$name]=$path ;;
      /*ld-linux*) loader=${line%% (*} ;;
    esac
  done < <(ldd "$b")
done
[ -n "$loader" ] || { echo "no ELF loader found by ldd" >&2; exit 1; }
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
  if [ "$(stat -c %s "$BUNDLE/lib/$name")" -gt $big ]; then
    gzip -9 "$BUNDLE/lib/$name"
  fi
done

c++ -shared -fPIC -O2 -std=c++17 -I"$CUDA_HOME/include" -Wl,--as-needed \
  -Wl,-soname,libnccl.so.2 -o "$BUNDLE/nccl-stub/libnccl.so.2" scripts/nccl_stub.cpp
strip --strip-unneeded "$BUNDLE/nccl-stub/libnccl.so.2"
for name in "${!cublas_libs[@]}"; do echo "$name"; done | sort >"$BUNDLE/cublas.txt"

{
  echo "pdsim GPU bundle"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version | head -1)"
  echo "source: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- 2>/dev/null || echo ' + local changes')"
  echo "cuda: $("$CUDA_HOME/bin/nvcc" --version | tail -1); archs: 90"
  grep -E "^-- +(CUDA|NCCL) +:" "$BUILD/configure.log" | sed 's/^-- *//'
  echo "tests: ${tests[*]}"
  echo "left out, from the GPU machine: libcuda.so.1, libnccl.so.2$(sed 's/^/, /' "$BUNDLE/cublas.txt" | tr -d '\n')"
  echo "files:"
  (cd "$BUNDLE" && find . -type f ! -name MANIFEST.txt -printf '  %p %s\n' | sort)
} >"$BUNDLE/MANIFEST.txt"
echo "bundle: $(du -sh "$BUNDLE" | cut -f1) in $(find "$BUNDLE" -type f | wc -l) files"

[ "${PDSIM_BUNDLE_VERIFY:-1}" = "1" ] || exit 0

echo "== verify: each binary in a chroot holding only the bundle"
jail=$(mktemp -d /tmp/pdsim-gpu-jail.XXXXXX)
trap 'rm -rf "$jail"' EXIT
cp -a "$BUNDLE" "$jail/gpu"
mkdir -p "$jail/tmp" "$jail/nccl" "$jail/cublas"
for f in "$jail"/gpu/lib/*.gz; do
  if [ -e "$f" ]; then gzip -d "$f"; fi
done
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
# Outside the jail: which files the loader actually opened must all be the bundle's.
# (cuBLAS comes from the jail's /cublas, the stand-in for the GPU machine's.)
stray=$(LD_DEBUG=libs "$BUNDLE/lib/ld-linux-x86-64.so.2" --inhibit-cache \
          --library-path "$jail/gpu/lib:$BUNDLE/nccl-stub:$jail/cublas" "$BUNDLE/bin/${tests[0]}" \
          --gtest_list_tests 2>&1 >/dev/null | sed -n 's/.*calling init: //p' \
          | grep -v -e "^$jail/gpu/lib/" -e "^$BUNDLE/" -e "^$jail/cublas/" || true)
if [ -n "$stray" ]; then echo "FAIL loaded from outside the bundle: $stray"; fail=1
else echo "ok   LD_DEBUG: every library ${tests[0]} loads comes from the bundle (cuBLAS: its stand-in)"; fi
if [ $fail -ne 0 ]; then echo "== bundle verification FAILED"; exit 1; fi
echo "== bundle verified"
