# Shared by run.sh and test.sh: bootstrap, configure and build one preset.
# Usage: source scripts/common.sh; pdsim_build <preset> [extra cmake args...]
PDSIM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PDSIM_JOBS="${PDSIM_JOBS:-$(nproc)}"
# OpenMPI refuses to run as root unless told; CI runs as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

pdsim_bootstrap() {
  "$PDSIM_ROOT/scripts/bootstrap.sh"
}

pdsim_build() {
  local preset="$1"; shift
  echo "== configure ($preset)"
  cmake --preset "$preset" "$@" >"$PDSIM_ROOT/build/configure-$preset.log" 2>&1 || {
    cat "$PDSIM_ROOT/build/configure-$preset.log"; return 1; }
  sed -n '/pdsim .* configuration/,/^-- $/p' "$PDSIM_ROOT/build/configure-$preset.log"
  echo "== build ($preset, -j$PDSIM_JOBS)"
  cmake --build --preset "$preset" -j "$PDSIM_JOBS"
}
