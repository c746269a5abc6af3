#!/usr/bin/env bash
# The simulator's fidelity over load (docs/fidelity.md section 8): for each topology, measure
# what the testbed serves, replay the trace at fractions of that, and put each testbed run beside
# `pdsim simulate --like` of its own report, as a user would check a simulation against their run.
#
#   1. cost model: COST if given, else the calibration path for simulating a topology, per
#      topology `pdsim calibrate --model tiny --topology <it> --out $OUT/cost-<it>.json`
#      (CALIBRATE=topology, the default: the serve probe runs that topology), or one file for the
#      topologies' TP sizes, `pdsim calibrate --model tiny --tp <their TP sizes> --out
#      $OUT/cost.json` (CALIBRATE=tp: the probe runs one prefill and one decode instance per TP);
#   2. capacity: a testbed run with every request arriving at once (--time-scale 1e-6); its
#      completed requests over its makespan (goodput_rps, no SLO) is the capacity C, req/s;
#   3. per load L in LOADS: the time scale that offers L x C (the N requests' span at scale 1 is
#      read from the trace), a testbed run at it (--report), then
#      `pdsim simulate --like <that report> --cost-model <cost>`;
#   4. a markdown table per topology -> $OUT/curve.md: offered rate, TTFT and TPOT p50 / p90 on
#      both sides and their ratios, throughput, the wait before prefill (queueing), the
#      testbed repeats' spread (max / min of their p50s), and whether the p50 ratios are within
#      10% (L <= 0.8) or 25% (above); and how many points' repeats spread by more than twice
#      the bar (where no simulation could be within it of every repeat); and how many repeats
#      lie within the bar of their own point's median (the testbed against itself: REPEATS=8
#      LOADS=0.3 measures whether a machine is quiet enough for the bar at all).
#
# Env: PDSIM (default build/default/sim/pdsim), OUT (out/fidelity-curve), TRACE
# (data/traces/azure_llm_conv.csv: a trace no calibration uses), N (requests, 100), LOADS
# ("0.3 0.5 0.7 0.8 0.9 1.1"), TOPOS ("cpu-1p1d cpu-2p1d-tp2-to-tp1"), COST (a cost file; empty:
# calibrate), BIND (core | none: rank binding as docs/fidelity.md section 2), TESTBED (run |
# reuse: keep $OUT's testbed reports and redo only the simulator side), REPEATS (testbed runs
# per load point, 3: each is simulated with --like, and the table shows the median over the
# repeats of each side's figure; one run's TPOT median moved 0.52 -> 0.72 ms between identical
# runs here).
# CALIBRATE (topology | tp, above).
# SIM_ARGS (extra `pdsim simulate` flags, e.g. "--speed-scale off") and SIM (the simulations'
# file prefix, "sim") let one set of testbed runs be simulated several ways (TESTBED=reuse).
# Prints a progress line per run. About 17 minutes on the 2-core machine with the defaults
# (2026-12-06; two calibrations included).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PDSIM="${PDSIM:-build/default/sim/pdsim}"
OUT="${OUT:-out/fidelity-curve}"
TRACE="${TRACE:-data/traces/azure_llm_conv.csv}"
N="${N:-100}"
LOADS="${LOADS:-0.3 0.5 0.7 0.8 0.9 1.1}"
TOPOS="${TOPOS:-cpu-1p1d cpu-2p1d-tp2-to-tp1}"
COST="${COST:-}"
BIND="${BIND:-core}"
TESTBED="${TESTBED:-run}"
REPEATS="${REPEATS:-3}"
SIM_ARGS="${SIM_ARGS:-}"
SIM="${SIM:-sim}"
CALIBRATE="${CALIBRATE:-topology}"
die() { echo "fidelity_curve.sh: $*" >&2; exit 2; }
[ -x "$PDSIM" ] || die "PDSIM=$PDSIM: no such binary (build first)"
[ -f "$TRACE" ] || die "TRACE=$TRACE: no such file"
[[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -ge 2 ] || die "N=$N: an integer >= 2"
for l in $LOADS; do
  python3 -c "import sys; v = float(sys.argv[1]); sys.exit(0 if 0 < v <= 10 else 1)" "$l" \
    2>/dev/null || die "LOADS: '$l' is not a number in (0, 10]"
done
for t in $TOPOS; do [ -f "topology/examples/$t.yaml" ] || die "TOPOS: no topology/examples/$t.yaml"; done
[ -z "$COST" ] || [ -f "$COST" ] || die "COST=$COST: no such file"
case "$BIND" in core | none) ;; *) die "BIND=$BIND: core or none" ;; esac
case "$TESTBED" in run | reuse) ;; *) die "TESTBED=$TESTBED: run or reuse" ;; esac
[[ "$REPEATS" =~ ^[1-9][0-9]*$ ]] || die "REPEATS=$REPEATS: an integer >= 1"
[[ "$SIM" =~ ^[A-Za-z0-9_.-]+$ ]] || die "SIM=$SIM: a file prefix (letters, digits, _ . -)"
case "$CALIBRATE" in topology | tp) ;; *) die "CALIBRATE=$CALIBRATE: topology or tp" ;; esac
read -r -a sim_args <<< "$SIM_ARGS"
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bind=()
[ "$BIND" = core ] && bind=(--map-by core --bind-to core:overload-allowed)
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }

testbed() {  # testbed TOPOLOGY REPORT ARGS...
  local topo=$1 report=$2
  shift 2
  local np
  np=$(awk '/^world_size:/ {print $2}' "topology/examples/$topo.yaml")
  mpirun --oversubscribe -np "$np" "${bind[@]}" --mca pml ob1 --mca btl self,vader,tcp \
    "$PDSIM" testbed --topology "topology/examples/$topo.yaml" --mode disagg --trace "$TRACE" \
    --max-requests "$N" --quiet "$@" --report "$report" > "${report%.json}.log" 2>&1 ||
    { echo "fidelity_curve.sh: testbed failed, see ${report%.json}.log" >&2; tail -5 "${report%.json}.log" >&2; exit 1; }
}

# cost_of TOPOLOGY: the cost file that topology is simulated with.
cost_of() {
  if [ -n "$COST" ]; then echo "$COST"
  elif [ "$CALIBRATE" = topology ]; then echo "$OUT/cost-$1.json"
  else echo "$OUT/cost.json"; fi
}
if [ -z "$COST" ] && [ "$CALIBRATE" = tp ]; then
  tps=$(for t in $TOPOS; do awk '/^ *tp:/ {print $2}' "topology/examples/$t.yaml"; done |
    sort -un | paste -sd, -)
  if [ ! -f "$OUT/cost.json" ] || [ "$TESTBED" = run ]; then
    echo "== calibrate: $PDSIM calibrate --model tiny --tp ${tps:-1} --out $OUT/cost.json (load $(loadavg))"
    "$PDSIM" calibrate --model tiny --tp "${tps:-1}" --out "$OUT/cost.json" > "$OUT/calibrate.log" 2>&1
  fi
fi

# The N requests' span at time scale 1, ms (the testbed replays the first N of the trace).
span_ms=$(python3 - "$TRACE" "$N" <<'EOF'
import csv, datetime, json, sys
path, n = sys.argv[1], int(sys.argv[2])
if path.endswith(".csv"):
    rows = [r["TIMESTAMP"] for _, r in zip(range(n), csv.DictReader(open(path)))]
    t = [datetime.datetime.strptime(x[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp() * 1000 for x in rows]
else:
    t = [json.loads(line)["timestamp"] for _, line in zip(range(n), open(path))]
print(max(t) - min(t))
EOF
)
echo "machine: $(nproc) cores; binding $BIND; trace $TRACE, first $N requests over $span_ms ms at scale 1"

for topo in $TOPOS; do
  cost=$(cost_of "$topo")
  if [ -z "$COST" ] && [ "$CALIBRATE" = topology ] && { [ ! -f "$cost" ] || [ "$TESTBED" = run ]; }; then
    echo "== calibrate: $PDSIM calibrate --model tiny --topology $topo --out $cost (load $(loadavg))"
    "$PDSIM" calibrate --model tiny --topology "$topo" --out "$cost" > "$OUT/calibrate-$topo.log" 2>&1
  fi
  cap_report="$OUT/capacity-$topo.json"
  if [ "$TESTBED" = run ] || [ ! -f "$cap_report" ]; then
    echo "== $topo: capacity (every request at once; load $(loadavg))"
    testbed "$topo" "$cap_report" --time-scale 1e-6
  fi
  cap=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['goodput_rps'])" "$cap_report")
  echo "   capacity $cap req/s"
  for l in $LOADS; do
    scale=$(python3 -c "import sys; n, s, l, c = map(float, sys.argv[1:]); print(f'{(n - 1) * 1000 / (s * l * c):.6g}')" \
      "$N" "$span_ms" "$l" "$cap")
    for rep in $(seq 1 "$REPEATS"); do
      tb="$OUT/testbed-$topo-$l-r$rep.json"
      if [ "$TESTBED" = run ] || [ ! -f "$tb" ]; then
        echo "== $topo: load $l run $rep/$REPEATS (time scale $scale; load $(loadavg))"
        testbed "$topo" "$tb" --time-scale "$scale"
      fi
      "$PDSIM" simulate --like "$tb" --cost-model "$cost" --quiet "${sim_args[@]}" \
        --report "$OUT/$SIM-$topo-$l-r$rep.json" > "$OUT/$SIM-$topo-$l-r$rep.log" 2>&1 ||
        { echo "fidelity_curve.sh: simulate failed, see $OUT/$SIM-$topo-$l-r$rep.log" >&2; exit 1; }
    done
  done
done

python3 - "$OUT" "$TOPOS" "$LOADS" "$REPEATS" "$SIM" <<'EOF'
import json, statistics, sys
out, topos, loads, repeats = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4])
sim_prefix = sys.argv[5]
load = lambda p: json.load(open(f"{out}/{p}.json"))

def merged(prefix):
    """The median over the repeats of each figure the table shows."""
    reps = [load(f"{prefix}-r{i}") for i in range(1, repeats + 1)]
    med = lambda f: statistics.median(f(r) for r in reps)
    m = {k: {q: med(lambda r: r[k][q]) for q in ("p50", "p90")}
         for k in ("ttft_ms", "tpot_ms", "prefill_wait_ms")}
    m["goodput_rps"] = med(lambda r: r["goodput_rps"])
    m["config"] = reps[0].get("config")
    # The simulations' machine-speed factors (pdsim simulate --speed-scale), one per repeat.
    m["speed"] = [r.get("config", {}).get("speed_scale", {}).get("factor", 1.0) for r in reps]
    # What they scaled ("decodes" with --speed-scale auto; older reports: every forward).
    m["speed_scales"] = (reps[0].get("config", {}).get("speed_scale", {})
                         .get("scales", "all forwards"))
    # How far the repeats of one command spread: max / min of their p50s (1: no spread).
    m["spread"] = {k: max(r[k]["p50"] for r in reps) / min(r[k]["p50"] for r in reps)
                   if min(r[k]["p50"] for r in reps) > 0 else float("nan")
                   for k in ("ttft_ms", "tpot_ms")}
    # Each repeat's p50s as a fraction of the repeats' median (the testbed against itself).
    m["to_median"] = [{k: r[k]["p50"] / m[k]["p50"] if m[k]["p50"] > 0 else float("nan")
                       for k in ("ttft_ms", "tpot_ms")} for r in reps]
    return m

rows = []
noisy = points = 0
own_within = own_total = 0  # testbed repeats within the bar of their own point's median
for topo in topos:
    cap = load(f"capacity-{topo}")["goodput_rps"]
    rows += [f"\n### {topo} (capacity {cap:.2f} req/s)\n",
             "| load | offered req/s | TTFT p50 tb / sim (ratio) | TTFT p90 tb / sim | "
             "TPOT p50 tb / sim (ratio) | TPOT p90 tb / sim | throughput req/s tb / sim | "
             "wait for prefill p50 tb / sim | speed x (per run) | "
             "testbed repeats' spread TTFT / TPOT p50 (max / min) | "
             "testbed repeats within the bar of their median | within |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for l in loads:
        tb, sim = merged(f"testbed-{topo}-{l}"), merged(f"{sim_prefix}-{topo}-{l}")
        arr = tb["config"]["request_set"]["arrival_ms"]  # the testbed's scaled arrivals
        offered = (len(arr) - 1) * 1000 / (max(arr) - min(arr)) if len(arr) > 1 else float("nan")
        ratio = lambda k: sim[k]["p50"] / tb[k]["p50"] if tb[k]["p50"] > 0 else float("nan")
        bound = 0.10 if float(l) <= 0.8 else 0.25
        ok = all(abs(ratio(k) - 1) <= bound for k in ("ttft_ms", "tpot_ms"))
        own = sum(all(abs(x[k] - 1) <= bound for k in ("ttft_ms", "tpot_ms"))
                  for x in tb["to_median"])
        own_within += own
        own_total += len(tb["to_median"])
        rows.append(
            f"| {l} | {offered:.2f} | {tb['ttft_ms']['p50']:.1f} / {sim['ttft_ms']['p50']:.1f} "
            f"({ratio('ttft_ms'):.2f}) | {tb['ttft_ms']['p90']:.1f} / {sim['ttft_ms']['p90']:.1f} | "
            f"{tb['tpot_ms']['p50']:.2f} / {sim['tpot_ms']['p50']:.2f} ({ratio('tpot_ms'):.2f}) | "
            f"{tb['tpot_ms']['p90']:.2f} / {sim['tpot_ms']['p90']:.2f} | "
            f"{tb['goodput_rps']:.2f} / {sim['goodput_rps']:.2f} | "
            f"{tb['prefill_wait_ms']['p50']:.1f} / {sim['prefill_wait_ms']['p50']:.1f} | "
            f"{', '.join(f'{x:.2f}' for x in sim['speed'])}"
            f"{' (decodes)' if sim['speed_scales'] == 'decodes' else ''} | "
            f"{tb['spread']['ttft_ms']:.2f} / {tb['spread']['tpot_ms']:.2f} | "
            f"{own} of {len(tb['to_median'])} | {'yes' if ok else 'no'} (±{bound:.0%}) |")
        # A bar narrower than the testbed's own repeat spread cannot be checked on this machine.
        noisy += any(tb["spread"][k] - 1 > 2 * bound for k in ("ttft_ms", "tpot_ms"))
        points += 1
rows.append(f"\nThe testbed's repeats spread by more than twice the bar at {noisy} of {points} "
            "points (max / min of the repeats' p50): there the machine, not the simulator, sets "
            "how close a simulation can come.")
rows.append(f"The testbed against itself: {own_within} of {own_total} repeats have TTFT and TPOT "
            "p50 within the bar of their point's median over the repeats (a simulation is one "
            "figure per point: where the repeats miss their own median, it misses some of them).")
table = "\n".join(rows)
print(table)
open(f"{out}/{'curve' if sim_prefix == 'sim' else 'curve-' + sim_prefix}.md", "w").write(table + "\n")
EOF
