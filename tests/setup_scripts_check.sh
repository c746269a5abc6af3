#!/usr/bin/env bash
# scripts/common.sh's disk check (ctest setup_scripts_check, label unit): scripts/test.sh and
# scripts/run.sh call pdsim_require_disk before they install or build anything, so that a full
# disk fails in a second with what to free instead of as a compiler error minutes in.
#   a build that cannot fit: status 1, the message names the build folder, the MiB and the way out;
#   one that fits, and PDSIM_SKIP_DISK_CHECK=1: status 0;
#   what build/ already holds counts towards the need (a rebuild overwrites it).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/pdsim-setup-scripts.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }
# shellcheck source=../scripts/common.sh
source "$ROOT/scripts/common.sh"
PDSIM_ROOT=$TMP/clone  # the check looks at $PDSIM_ROOT/build only
unset PDSIM_SKIP_DISK_CHECK
free_mib() { df -Pm "$TMP" | awk 'NR==2 {print $4}'; }

msg=$(pdsim_require_disk 999999999 "the test's build" 2>&1); rc=$?
[ $rc -eq 1 ] || bad "an impossible need returned $rc, want 1"
for want in "not enough disk for the test's build" "999999999 MiB" "$TMP/clone/build" \
            "PDSIM_SKIP_DISK_CHECK=1"; do
  case "$msg" in *"$want"*) ;; *) bad "the message lacks '$want': $msg" ;; esac
done
[ -d "$TMP/clone/build" ] || bad "the check did not create the build folder it measures"

pdsim_require_disk 1 "a small build" || bad "a 1 MiB need failed with $(free_mib) MiB free"
PDSIM_SKIP_DISK_CHECK=1 pdsim_require_disk 999999999 "anything" ||
  bad "PDSIM_SKIP_DISK_CHECK=1 did not skip the check"

# 64 MiB already built: a need 32 MiB above what is free fits, one 96 MiB above does not.
head -c $((64 << 20)) /dev/zero > "$TMP/clone/build/objects" || bad "cannot write 64 MiB"
have=$(free_mib)
pdsim_require_disk $((have + 32)) "a rebuild" 2>/dev/null ||
  bad "a need of free + 32 MiB failed with 64 MiB built"
pdsim_require_disk $((have + 96)) "a rebuild" 2>/dev/null &&
  bad "a need of free + 96 MiB passed with only 64 MiB built"

[ $fail -eq 0 ] && echo "setup_scripts_check: all checks passed"
exit $fail
