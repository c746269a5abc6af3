#!/usr/bin/env bash
# ctest `install_test`: `cmake --install` of this build into a fresh prefix, then the installed
# pdsim run from / (not from the source tree), reading only the installed data
# (PDSIM_DATA_DIR=<prefix>/share/pdsim): the default testbed experiment (a short sample), a
# simulation by shipped names, and the installed plot script on the testbed's report.
# Usage: install_check.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
pfx=$(mktemp -d "${TMPDIR:-/tmp}/pdsim-install.XXXXXX")
trap 'rm -rf "$pfx"' EXIT
fail() { echo "install_test: FAILED: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$pfx" >"$pfx/install.log" 2>&1 || { cat "$pfx/install.log"; fail "cmake --install"; }
for f in bin/pdsim share/pdsim/traces/mooncake_conversation.jsonl share/pdsim/traces/azure_llm_code.csv share/pdsim/traces/azure_llm_conv.csv \
         share/pdsim/topologies/cpu-1p1d.yaml share/pdsim/topologies/dgx-h100-2node-1p1d-tp8.yaml \
         share/pdsim/models/llama3-8b-4l.yaml share/pdsim/plot_report.py share/pdsim/README.md; do
  [ -e "$pfx/$f" ] || fail "$f not installed"
done
echo "install_test: installed into $pfx"

export PDSIM_DATA_DIR=$pfx/share/pdsim OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd /
timeout 240 "$pfx/bin/pdsim" testbed --sample 4 --report "$pfx/report.json" >"$pfx/testbed.log" 2>&1 \
  || { cat "$pfx/testbed.log"; fail "installed pdsim testbed (from /)"; }
grep -q "requests completed" "$pfx/testbed.log" || { cat "$pfx/testbed.log"; fail "no summary table"; }
grep -q "mooncake_conversation.jsonl" "$pfx/testbed.log" || fail "the default trace was not used"
echo "install_test: testbed ok"

timeout 120 "$pfx/bin/pdsim" simulate --topology dgx-h100-2node-1p1d-tp8 --model llama3-70b \
  --trace mooncake_conversation --max-requests 50 >"$pfx/simulate.log" 2>&1 \
  || { cat "$pfx/simulate.log"; fail "installed pdsim simulate by shipped names"; }
grep -q "requests completed" "$pfx/simulate.log" || { cat "$pfx/simulate.log"; fail "no simulate summary"; }
echo "install_test: simulate ok"

# A missing data folder is an error that names it (exit 2), not a silent fallback.
rc=0
PDSIM_DATA_DIR=$pfx/nowhere timeout 60 "$pfx/bin/pdsim" testbed --sample 2 >"$pfx/bad.log" 2>&1 || rc=$?
[ "$rc" -eq 2 ] || { cat "$pfx/bad.log"; fail "PDSIM_DATA_DIR=nowhere: exit $rc, expected 2"; }
grep -q "PDSIM_DATA_DIR" "$pfx/bad.log" || { cat "$pfx/bad.log"; fail "the message does not name PDSIM_DATA_DIR"; }

py=python3
[ -x /usr/bin/python3 ] && py=/usr/bin/python3  # Debian's, with python3-matplotlib (bootstrap.sh)
if "$py" -c "import matplotlib" 2>/dev/null; then
  "$py" "$pfx/share/pdsim/plot_report.py" "$pfx/report.json" --out "$pfx/plots" >"$pfx/plot.log" 2>&1 \
    || { cat "$pfx/plot.log"; fail "installed plot_report.py"; }
  for p in ttft_cdf tpot_cdf layer_latency overlap; do
    [ -s "$pfx/plots/$p.png" ] || fail "plot $p.png missing"
  done
  echo "install_test: plots ok"
else
  echo "install_test: matplotlib not installed: plots not checked"
fi
echo "install_test: passed"
