#!/usr/bin/env bash
# Installs the Debian packages pdsim needs, only those that are missing (a no-op when all are
# present). Uses sudo when not root. CUDA Toolkit and NCCL are optional and never installed here:
# CMake finds them under /usr/local/cuda, $CUDA_HOME or $NCCL_HOME when they exist.
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
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "bootstrap: all ${#PACKAGES[@]} packages present"
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
echo "bootstrap: done"
