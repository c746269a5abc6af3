#!/usr/bin/env bash
# Installs the Debian packages pdsim needs, only those that are missing (a no-op when all are
# present). Uses sudo when not root. CUDA Toolkit and NCCL are optional and never installed here:
# CMake finds them under /usr/local/cuda, $CUDA_HOME or $NCCL_HOME when they exist. Where a CUDA
# toolkit is present, the last step fetches FlashInfer's headers (scripts/fetch_flashinfer.sh).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libopenmpi-dev openmpi-bin
  libboost-dev
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
  libspdlog-dev libfmt-dev
  libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-matplotlib
  clang-format clang
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# FlashInfer's headers for the CUDA attention backend (scripts/fetch_flashinfer.sh), only where a
# CUDA toolkit is present. Runs after the packages (it needs python3), as the last step.
fetch_flashinfer_if_cuda() {
  local nvcc=""
  for cand in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc; do
    if [ -n "$cand" ] && [ -x "$cand" ]; then nvcc="$cand"; break; fi
  done
  if [ -z "$nvcc" ]; then
    echo "bootstrap: no CUDA toolkit (no nvcc in \$CUDA_HOME/bin or /usr/local/cuda/bin):" \
         "FlashInfer not fetched"
    return 0
  fi
  if ! "$(dirname "${BASH_SOURCE[0]}")/fetch_flashinfer.sh"; then
    echo "bootstrap: error: fetching FlashInfer failed (see above); without it CMake builds pdsim" \
         "without the CUDA attention backend" >&2
    exit 1
  fi
}

if [ ${#missing[@]} -eq 0 ]; then
  echo "bootstrap: all ${#PACKAGES[@]} packages present"
  fetch_flashinfer_if_cuda
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "bootstrap: missing packages (${missing[*]}) and not root, no sudo" >&2
    exit 1
  fi
fi

echo "bootstrap: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fetch_flashinfer_if_cuda
echo "bootstrap: done"
