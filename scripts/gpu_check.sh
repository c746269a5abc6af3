#!/usr/bin/env bash
# One-shot GPU check, for a machine with an NVIDIA GPU: builds pdsim with CUDA (and NCCL when
# found), runs the tests labelled `cuda`, and prints a short table. Writes logs under $OUT (or out/).
# It installs nothing with apt unless PDSIM_GPU_BOOTSTRAP=1 (GPU machines are often bare).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-out}"
mkdir -p "$OUT_DIR" build
[ "${PDSIM_GPU_BOOTSTRAP:-0}" = "1" ] && scripts/bootstrap.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  >"$OUT_DIR/gpu.txt" 2>&1 || echo "nvidia-smi failed" >"$OUT_DIR/gpu.txt"
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPDSIM_WITH_CUDA=ON \
  -DPDSIM_CUDA_ARCHITECTURES=90 -DPDSIM_BUILD_BENCH=OFF >"$OUT_DIR/configure.log" 2>&1
cfg=$?
build=1
if [ $cfg -eq 0 ]; then
  cmake --build build/gpu -j"$(nproc)" >"$OUT_DIR/build.log" 2>&1; build=$?
fi
tests="not run"
if [ $build -eq 0 ]; then
  (cd build/gpu && ctest -L cuda --output-on-failure >"../../$OUT_DIR/ctest_cuda.log" 2>&1)
  tests=$(grep -E "tests passed|tests failed" "$OUT_DIR/ctest_cuda.log" | tail -1)
fi

echo "| item | result |"
echo "|---|---|"
echo "| GPU | $(head -1 "$OUT_DIR/gpu.txt") |"
echo "| configure | $([ $cfg -eq 0 ] && echo ok || echo FAILED) |"
echo "| build | $([ $build -eq 0 ] && echo ok || echo FAILED) |"
echo "| ctest -L cuda | ${tests} |"
grep -hE "^\[  (SKIPPED|FAILED) \]" "$OUT_DIR/ctest_cuda.log" 2>/dev/null | sed 's/^/| detail | /; s/$/ |/' | head -20
