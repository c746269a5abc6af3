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

# What a build from nothing writes under build/ (MiB; measured 2026-12-05 on a clean clone): the
# release build alone about 1 GiB; a CI run's release, sanitizer and fuzz builds 3.6 GiB.
PDSIM_DISK_RELEASE_MIB=1200
PDSIM_DISK_ALL_STAGES_MIB=3800

# Fails before any build when the disk cannot hold one: a full disk otherwise stops the compiler
# half-way ("fatal error: error writing to /tmp/cc....s: No space left on device"), minutes in.
# `need_mib` is what a build from nothing writes under build/; what build/ already holds counts
# towards it (a rebuild overwrites it). The compiler's temporary files go to TMPDIR (/tmp).
# PDSIM_SKIP_DISK_CHECK=1 skips it.
pdsim_require_disk() {
  local need_mib="$1" what="$2"
  [ "${PDSIM_SKIP_DISK_CHECK:-}" = "1" ] && return 0
  mkdir -p "$PDSIM_ROOT/build"
  local have_mib built_mib tmp_mib
  have_mib=$(df -Pm "$PDSIM_ROOT/build" | awk 'NR==2 {print $4}')
  built_mib=$(du -sm "$PDSIM_ROOT/build" 2>/dev/null | awk '{print $1}')
  tmp_mib=$(df -Pm "${TMPDIR:-/tmp}" | awk 'NR==2 {print $4}')
  local short=$(( need_mib - built_mib - have_mib ))
  if [ "$short" -gt 0 ] || [ "$tmp_mib" -lt 512 ]; then
    echo "pdsim: not enough disk for $what: it writes about $need_mib MiB under" \
         "$PDSIM_ROOT/build (which holds $built_mib MiB) and $have_mib MiB are free there;" \
         "${TMPDIR:-/tmp} has $tmp_mib MiB free (the compiler needs 512). Free some space (old" \
         "clones and build folders), or set PDSIM_SKIP_DISK_CHECK=1 to try anyway." >&2
    return 1
  fi
}

pdsim_configure() {
  local preset="$1"; shift
  echo "== configure ($preset) [+$(( $(date +%s) - ${PDSIM_STAGE_T0:-$(date +%s)} )) s]"
  cmake --preset "$preset" "$@" >"$PDSIM_ROOT/build/configure-$preset.log" 2>&1 || {
    cat "$PDSIM_ROOT/build/configure-$preset.log"; return 1; }
}

# Builds only the executables of the tests that ctest selects with the given arguments (test names
# equal target names; variants such as cpu_attention_test_avx2 and the gtest shards
# cpu_attention_test_shard0, _shard1 run the cpu_attention_test target).
pdsim_build_tests() {
  local preset="$1"; shift
  local targets
  targets=$(cd "$PDSIM_ROOT/build/$preset" && ctest -N "$@" | sed -n 's/^ *Test *#[0-9]*: //p' \
            | sed -E 's/_(avx2|scalar|shard[0-9]+)$//' | sort -u | tr '\n' ' ')
  echo "== build ($preset, -j$PDSIM_JOBS): $targets [+$(( $(date +%s) - ${PDSIM_STAGE_T0:-$(date +%s)} )) s]"
  # shellcheck disable=SC2086
  cmake --build --preset "$preset" -j "$PDSIM_JOBS" --target $targets
}

pdsim_build() {
  local preset="$1"; shift
  echo "== configure ($preset) [+$(( $(date +%s) - ${PDSIM_STAGE_T0:-$(date +%s)} )) s]"
  cmake --preset "$preset" "$@" >"$PDSIM_ROOT/build/configure-$preset.log" 2>&1 || {
    cat "$PDSIM_ROOT/build/configure-$preset.log"; return 1; }
  sed -n '/pdsim .* configuration/,/^-- $/p' "$PDSIM_ROOT/build/configure-$preset.log"
  echo "== build ($preset, -j$PDSIM_JOBS) [+$(( $(date +%s) - ${PDSIM_STAGE_T0:-$(date +%s)} )) s]"
  cmake --build --preset "$preset" -j "$PDSIM_JOBS"
}
