#!/usr/bin/env bash
# The testbed across three hosts of the namespace cluster (scripts/netns_cluster.py): prefill0 and
# the router on h0, decode0 on h1, decode1 on h2, under OpenMPI's rsh launcher, over the tcp
# transport (--tcp-interface pdsim0). Each case checks the report: every request accounted for
# (completed + failed + lost == submitted), 0 ordering violations, and what the fault should do.
#   clean       every request completes
#   delay       200 ms more one-way delay on h2's link, from the start: every request completes
#   loss        5% packet loss on h1's link, from the start: every request completes
#   link-down   h2's link cut once 3 requests finished: the run ends within 15 s of the cut (h2's
#               heartbeats stop: decode1 is dead), the report adds up and names rank 2
#   kill-rank   the pdsim process on h2 killed once 3 requests finished (mpirun --enable-recovery):
#               the other instances run on, none lost, the report's dead_ranks names rank 2, and
#               the job ends within 15 s of the kill
#   host-lost   every process on h2 killed (mpirun's daemon too) once 3 requests finished: mpirun
#               cannot recover a lost daemon and ends the job; rank 0 writes the report (SIGTERM)
#               within 15 s, or its report keeper does when mpirun's SIGKILL, 1 s after the
#               SIGTERM, came first (a loaded host)
# Usage: tests/netns_cluster_check.sh PDSIM_BINARY [CASE...]   (default: every case);
# PDSIM_NETNS_KEEP=1 keeps the work directory (each case's report, out and err) for a look.
# Exit 0 pass, 77 skipped (not root, no TUN, no iproute2: the reason printed), else failed.
set -uo pipefail

pdsim=${1:?usage: netns_cluster_check.sh PDSIM_BINARY [CASE...]}
shift
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(clean delay loss link-down kill-rank host-lost)
here=$(cd "$(dirname "$0")/.." && pwd)
cluster="$here/scripts/netns_cluster.py"

skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces)"
[ -e /dev/net/tun ] || skip "no /dev/net/tun"
command -v ip >/dev/null || skip "no iproute2 (ip)"
command -v mpirun >/dev/null || skip "no mpirun"
ip netns add "pdsimprobe$$" 2>/dev/null || skip "cannot create a network namespace here"
ip netns del "pdsimprobe$$"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
name="nc$(( $$ % 100000 ))"
subnet="10.79.$(( $$ % 200 + 20 ))"
work=$(mktemp -d /tmp/pdsim-netns-check.XXXXXX)
export PDSIM_NETNS_DIR="$work/state"
cleanup() { python3 "$cluster" --name "$name" down >/dev/null 2>&1; [ -n "${PDSIM_NETNS_KEEP:-}" ] || rm -rf "$work"; }
trap cleanup EXIT

python3 "$cluster" --name "$name" up --hosts 3 --subnet "$subnet" || exit 1
agent="$(python3 "$cluster" --name "$name" mpirun-args | sed -n "s/.*plm_rsh_agent '\([^']*\)'.*/\1/p")"
failures=0

# run CASE EXTRA_MPIRUN_ARGS -- after the start: a shell command run once 3 requests finished
run_case() {
    local case=$1 extra=$2 fault=$3
    local dir="$work/$case"
    mkdir -p "$dir"
    local -a cmd=(mpirun --hostfile "$PDSIM_NETNS_DIR/$name/hostfile" --mca plm_rsh_agent "$agent"
                  --mca oob_tcp_if_include "$subnet.0/24" --mca btl_tcp_if_include "$subnet.0/24"
                  --mca oob_tcp_keepalive_time 2 --mca oob_tcp_keepalive_intvl 1
                  --mca oob_tcp_keepalive_probes 3
                  --mca pml ob1 --mca btl self,tcp -np 3 --map-by node $extra
                  "$pdsim" testbed --topology cpu-1p2d --synthetic 24 --mode disagg
                  --transport tcp --tcp-interface pdsim0 --request-timeout-s 60 --quiet
                  --report "$dir/r.json")
    timeout -k 10 240 "${cmd[@]}" >"$dir/out" 2>"$dir/err" </dev/null &
    local pid=$! t_fault=""
    if [ -n "$fault" ]; then
        for _ in $(seq 1 900); do
            n=$(cat "$dir/r.json.journal.jsonl" 2>/dev/null | wc -l)
            [ "$n" -gt 3 ] && break
            kill -0 $pid 2>/dev/null || break
            sleep 0.1
        done
        eval "$fault" >"$dir/fault" 2>&1
        t_fault=$(date +%s.%N)
    fi
    wait $pid
    local rc=$? t_end
    t_end=$(date +%s.%N)
    local after=""
    [ -n "$t_fault" ] && after=$(python3 -c "print(f'{$t_end - $t_fault:.1f}')")
    echo "== $case: exit $rc${after:+, ended ${after} s after the fault}"
    python3 - "$dir/r.json" "$case" "${after:-0}" <<'EOF'
import json, sys, time
path, case, after = sys.argv[1], sys.argv[2], float(sys.argv[3])
# A report written by rank 0's report keeper (rank 0 killed before it wrote one: mpirun's SIGKILL
# comes 1 s after its SIGTERM) may land just after mpirun ended: wait for it up to 10 s.
for attempt in range(101):
    try:
        r = json.load(open(path))
        break
    except Exception as e:
        if attempt == 100:
            print(f"   FAIL: no report within 10 s of the end ({e})"); sys.exit(1)
        time.sleep(0.1)
s, c, f, l = (r.get(k, -1) for k in
              ("requests_submitted", "requests_completed", "requests_failed", "requests_lost"))
dead = [d["rank"] for d in r.get("dead_ranks", [])]
quiet = [d["rank"] for d in r.get("silent_ranks", [])]
viol = r.get("ordering", {}).get("violations", 0)
print(f"   {c} completed, {f} failed, {l} lost of {s}; violations {viol}; dead ranks {dead}; "
      f"silent {quiet}; "
      f"incomplete: {r.get('incomplete', {}).get('cause', '-')[:120]}")
bad = []
if c + f + l != s or s != 24: bad.append("the counts do not add up to 24")
if viol: bad.append("ordering violations")
if case in ("clean", "delay", "loss") and c != s: bad.append("not every request completed")
if case == "link-down":
    if after > 15: bad.append(f"ended {after} s after the cut (> 15)")
    silent = [d["rank"] for d in r.get("silent_ranks", [])]
    if 2 not in dead and 2 not in silent:
        bad.append("rank 2 not named (dead_ranks or silent_ranks)")
if case == "kill-rank":
    if l != 0: bad.append("requests lost")
    if 2 not in dead: bad.append("dead_ranks does not name rank 2")
    if c < s // 2: bad.append("the surviving instances did not run on")
if case in ("kill-rank", "host-lost") and after > 15:
    bad.append(f"ended {after} s after the kill (> 15)")
if case == "host-lost" and not r.get("incomplete"):
    bad.append("the report does not say the run stopped early")
for b in bad: print("   FAIL:", b)
if bad:
    # What the failed requests said, so that a failure in CI can be read from its log.
    for fail in r.get("failures", [])[:5]:
        print("   failure:", json.dumps(fail)[:300])
sys.exit(1 if bad else 0)
EOF
    local st=$?
    if [ $st -ne 0 ]; then
        failures=$((failures + 1))
        tail -5 "$dir/err" | sed 's/^/   err: /'
    fi
    python3 "$cluster" --name "$name" link h1 --delay-ms 0 --loss 0 --up >/dev/null
    python3 "$cluster" --name "$name" link h2 --delay-ms 0 --loss 0 --up >/dev/null
}

for c in "${cases[@]}"; do
    case $c in
        clean) run_case clean "" "" ;;
        delay)
            python3 "$cluster" --name "$name" link h2 --delay-ms 200 >/dev/null
            run_case delay "" "" ;;
        loss)
            python3 "$cluster" --name "$name" link h1 --loss 0.05 >/dev/null
            run_case loss "" "" ;;
        link-down)
            run_case link-down "" "python3 '$cluster' --name '$name' link h2 --down" ;;
        kill-rank)
            run_case kill-rank "--enable-recovery" \
                "python3 '$cluster' --name '$name' kill h2 --match '$pdsim testbed'" ;;
        host-lost)
            run_case host-lost "" "python3 '$cluster' --name '$name' kill h2" ;;
        *) echo "unknown case '$c' (clean delay loss link-down kill-rank host-lost)" >&2; exit 2 ;;
    esac
done
echo "netns cluster: $(( ${#cases[@]} - failures )) of ${#cases[@]} cases passed"
[ $failures -eq 0 ]
