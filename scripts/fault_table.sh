#!/usr/bin/env bash
# Kills or stops one rank of a running `pdsim testbed` and prints how the run ended: the
# reliability table of docs/testbed.md ("When a rank dies"). One row per argument:
#
#   scripts/fault_table.sh [PDSIM] ROW...
#   ROW = NAME:NP:TOPOLOGY:TRANSPORT:RANK:ACTION[:ENV=VALUE]
#     NP        ranks (mpirun -np)             TOPOLOGY  an example name (cpu-1p1d) or a file
#     TRANSPORT mpi | tcp                      RANK      the rank to hit (0 is prefill + router)
#     ACTION    kill (SIGKILL) | stop (SIGSTOP, never continued) | stopN (SIGSTOP, SIGCONT N s later)
#     ENV       one extra variable for mpirun, e.g. OMPI_MCA_orte_enable_recovery=1
#   e.g. scripts/fault_table.sh build/default/sim/pdsim kill-dec-mpi:2:cpu-1p1d:mpi:1:kill
#
# Each run: `--synthetic 200 --mode disagg`, the fault 3 s after the first request finished (read
# from the report's journal, which rank 0 writes as requests finish), a 120 s guard (SIGKILL of mpirun,
# then "guard" in the table). Columns: mpirun's exit status, seconds from the fault to mpirun's
# exit, completed/failed/lost, whether they add up to submitted, the report's incomplete.cause
# (first 60 characters), dead_ranks / silent_ranks, ordering violations. "no report" when the
# report file is missing or not JSON. Needs mpirun (OpenMPI) and python3.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
pdsim="$here/build/default/sim/pdsim"
if [ $# -gt 0 ] && [ -x "$1" ] && [ ! -d "$1" ]; then pdsim="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; shift; fi
[ $# -gt 0 ] || { sed -n 2,18p "$0"; exit 2; }
[ -x "$pdsim" ] || { echo "fault_table.sh: $pdsim: not built (scripts/test.sh builds it)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "fault_table.sh: mpirun not found" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1
export OMPI_MCA_btl=self,vader,tcp
work="$(mktemp -d "${TMPDIR:-/tmp}/pdsim-fault-table.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# pid of `rank` among the processes whose command line holds `marker` (this run's report path).
rank_pid() {
  local marker="$1" rank="$2" p
  for p in /proc/[0-9]*; do
    tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -q -- "$marker" || continue
    tr '\0' '\n' < "$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$rank" || continue
    tr '\0' ' ' < "$p/cmdline" | grep -q "^mpirun" && continue
    echo "${p#/proc/}"; return 0
  done
  return 1
}

echo "| row | rc | s after fault | completed/failed/lost | adds up | cause | dead / silent | violations |"
echo "|---|---|---|---|---|---|---|---|"
for row in "$@"; do
  IFS=: read -r name np topo transport rank action env <<< "$row"
  if [ -z "$action" ]; then echo "fault_table.sh: $row: expected NAME:NP:TOPOLOGY:TRANSPORT:RANK:ACTION[:ENV]" >&2; exit 2; fi
  case "$action" in kill|stop|stop[0-9]*) ;; *) echo "fault_table.sh: $row: action $action: kill, stop or stopN" >&2; exit 2;; esac
  [ -f "$topo" ] || topo="$here/topology/examples/$topo.yaml"
  report="$work/$name.json"; csv="$work/$name.csv"
  env_args=(); [ -n "$env" ] && env_args=(-x "$env") && export "${env?}"
  mpirun --oversubscribe -np "$np" "${env_args[@]}" "$pdsim" testbed --topology "$topo" \
    --transport "$transport" --synthetic 200 --mode disagg --quiet \
    --report "$report" --requests "$csv" > "$work/$name.log" 2>&1 &
  launcher=$!
  # The fault: 3 s after the first finished request.
  for _ in $(seq 600); do
    [ "$(wc -l 2>/dev/null < "$report.journal.jsonl" || echo 0)" -ge 2 ] && break
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.1
  done
  sleep 3
  pid=$(rank_pid "$report" "$rank") || pid=""
  t_fault=$(date +%s.%N)
  if [ -z "$pid" ]; then echo "| $name | (rank $rank not found: the run ended first) |||||||"; wait "$launcher"; continue; fi
  case "$action" in
    kill) kill -KILL "$pid" ;;
    stop) kill -STOP "$pid" ;;
    stop*) kill -STOP "$pid"; ( sleep "${action#stop}"; kill -CONT "$pid" 2>/dev/null ) & ;;
  esac
  guard=""
  for _ in $(seq 1200); do kill -0 "$launcher" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$launcher" 2>/dev/null; then
    guard=" (guard)"; kill -KILL "$launcher" 2>/dev/null
    pkill -KILL -f -- "$report" 2>/dev/null
  fi
  wait "$launcher"; rc=$?
  [ -n "$pid" ] && kill -CONT "$pid" 2>/dev/null
  after=$(python3 -c "import time; print(f'{time.time() - $t_fault:.1f}')")
  python3 - "$report" "$name" "$rc$guard" "$after" <<'EOF'
import json, sys
path, name, rc, after = sys.argv[1:5]
try:
    r = json.load(open(path))
except Exception:
    print(f"| {name} | {rc} | {after} | no report | | | | |")
    sys.exit(0)
c, f, l, s = (r.get(k, 0) for k in ("requests_completed", "requests_failed", "requests_lost",
                                      "requests_submitted"))
cause = (r.get("incomplete") or {}).get("cause", "")[:60].replace("|", "/")
dead = [d.get("rank") for d in r.get("dead_ranks", [])]
silent = [d.get("rank") for d in r.get("silent_ranks", [])]
v = (r.get("ordering") or {}).get("violations", 0)
v = len(v) if isinstance(v, list) else v
print(f"| {name} | {rc} | {after} | {c}/{f}/{l} of {s} | {'yes' if c + f + l == s else 'NO'} "
      f"| {cause} | {dead} / {silent} | {v} |")
EOF
  if [ -n "$env" ]; then unset "${env%%=*}"; fi
done
exit 0
