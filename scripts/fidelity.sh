#!/usr/bin/env bash
# Simulator fidelity against the CPU testbed on this machine (docs/fidelity.md):
#   1. calibrate: CALIBRATE=1 (default) pdsim calibrate's microbenchmark (tiny, TP 1 and 2, 1
#      thread per rank: what both topologies run here); CALIBRATE=testbed that too (it supplies
#      the fits the testbed runs have no forwards of: TP-2 decode), then CAL_RUNS testbed runs
#      per topology on a different request set (seed CAL_SEED) with --timeline, and
#      pdsim calibrate --from-timeline over those timelines -> $OUT/cost-testbed.json;
#      CALIBRATE=0 reuses $OUT/cost.json (and $OUT/cost-testbed.json in testbed mode: CALIBRATE=0
#      with TESTBED_COST=1);
#   2. for cpu-1p1d and cpu-2p1d-tp2-to-tp1: the testbed under mpirun (REPEATS times, seed 1),
#      then pdsim simulate on the same topology, model, trace sample, caps and time scale with the
#      cost file (core contention on, and off for reference; testbed mode: also with the
#      microbenchmark file);
#   3. a markdown table of median TTFT / TPOT: testbed (median of the repeats, and their range),
#      simulator, ratio, within 5%?  -> $OUT/fidelity.md (and stdout).
# Env: PDSIM (binary, default build/fidelity/sim/pdsim), OUT (out/fidelity), SAMPLE (96),
# SCALE (0.012), REPEATS (3), CALIBRATE (1 | testbed | 0), CAL_REPEATS (3), CAL_RUNS (1),
# CAL_SEED (2), TESTBED_COST (with CALIBRATE=0: 1 uses $OUT/cost-testbed.json).
# About 6 minutes on the 2-core machine (CALIBRATE=testbed: about 8).
set -euo pipefail
cd "$(dirname "$0")/.."
PDSIM=${PDSIM:-build/fidelity/sim/pdsim}
OUT=${OUT:-out/fidelity}
SAMPLE=${SAMPLE:-96}
SCALE=${SCALE:-0.012}
REPEATS=${REPEATS:-3}
CALIBRATE=${CALIBRATE:-1}
CAL_REPEATS=${CAL_REPEATS:-3}
CAL_RUNS=${CAL_RUNS:-1}
CAL_SEED=${CAL_SEED:-2}
TESTBED_COST=${TESTBED_COST:-0}
[ "$CALIBRATE" = testbed ] && TESTBED_COST=1
TRACE=${TRACE:-../shared/data/traces/mooncake_conversation.jsonl}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The same requests on both sides: sample, seed, caps (the testbed's defaults), time scale.
CAPS=(--time-scale "$SCALE" --max-input-len 1024 --max-output-len 32)
WORKLOAD=(--trace "$TRACE" --sample "$SAMPLE" --seed 1 "${CAPS[@]}")
TOPOS=(cpu-1p1d cpu-2p1d-tp2-to-tp1)
testbed() {  # testbed TOPOLOGY OUTPUT_PREFIX ARGS...
    local yaml=topology/examples/$1.yaml prefix=$2
    shift 2
    local np
    np=$(awk '/^world_size:/ {print $2}' "$yaml")
    mpirun --oversubscribe -np "$np" --mca pml ob1 --mca btl self,vader,tcp \
        "$PDSIM" testbed --topology "$yaml" --mode disagg "$@" --quiet \
        --report "$prefix.json" > "$prefix.log" 2>&1
}
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
echo "machine: $(nproc) cores, $(uname -m); start $(date -u +%FT%TZ), load $(loadavg)" |
    tee "$OUT/machine.txt"

if [ "$CALIBRATE" != 0 ] || [ ! -f "$OUT/cost.json" ]; then
    echo "== calibrate (load $(loadavg))"
    "$PDSIM" calibrate --model tiny --tp 1,2 --threads 1 --transport none \
        --repeats "$CAL_REPEATS" --out "$OUT/cost.json" > "$OUT/calibrate.log" 2>&1
fi
if [ "$CALIBRATE" = testbed ] || { [ "$TESTBED_COST" = 1 ] && [ ! -f "$OUT/cost-testbed.json" ]; }
then
    # Other requests than the validation runs' (seed 1): the fit must predict runs it has not seen.
    timelines=()
    for topo in "${TOPOS[@]}"; do
        for i in $(seq 1 "$CAL_RUNS"); do
            echo "== calibration testbed $topo run $i (seed $CAL_SEED; load before $(loadavg))"
            testbed "$topo" "$OUT/caltestbed-$topo-$i" --trace "$TRACE" --sample "$SAMPLE" \
                --seed "$CAL_SEED" "${CAPS[@]}" --timeline "$OUT/caltimeline-$topo-$i.json"
            timelines+=("$OUT/caltimeline-$topo-$i.json")
        done
    done
    echo "== calibrate --from-timeline"
    "$PDSIM" calibrate --from-timeline "$(IFS=,; echo "${timelines[*]}")" --base "$OUT/cost.json" \
        --model tiny --out "$OUT/cost-testbed.json" > "$OUT/calibrate-testbed.log" 2>&1
fi
COST=$OUT/cost.json
[ "$TESTBED_COST" = 1 ] && COST=$OUT/cost-testbed.json

simulate() {  # simulate TOPOLOGY COST CONTENTION OUTPUT_PREFIX
    "$PDSIM" simulate --topology "topology/examples/$1.yaml" --mode disagg "${WORKLOAD[@]}" \
        --cost-model "$2" --prefix-cache off --kv-admission full \
        --max-decode-kv-tokens 2048 --cpu-contention "$3" --quiet \
        --report "$4.json" > "$4.log" 2>&1
}
for topo in "${TOPOS[@]}"; do
    np=$(awk '/^world_size:/ {print $2}' "topology/examples/$topo.yaml")
    for i in $(seq 1 "$REPEATS"); do
        echo "== testbed $topo run $i (mpirun -np $np; load before $(loadavg))"
        testbed "$topo" "$OUT/testbed-$topo-$i" "${WORKLOAD[@]}"
        echo "   load after $(loadavg)" | tee -a "$OUT/machine.txt"
    done
    for cont in on off; do
        echo "== simulate $topo (cpu contention $cont, $COST)"
        simulate "$topo" "$COST" "$cont" "$OUT/sim-$topo-contention-$cont"
    done
    if [ "$TESTBED_COST" = 1 ]; then
        echo "== simulate $topo (microbenchmark calibration $OUT/cost.json)"
        simulate "$topo" "$OUT/cost.json" on "$OUT/sim-$topo-micro-contention-on"
    fi
done
echo "end $(date -u +%FT%TZ), load $(loadavg)" | tee -a "$OUT/machine.txt"

python3 - "$OUT" "$REPEATS" "$TESTBED_COST" <<'EOF'
import json, statistics, sys
out, repeats, micro = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
extra = " simulator, microbenchmark calibration (ratio) |" if micro else ""
rows = ["| topology | metric | testbed p50 of each run | testbed p50 (median of runs) | "
        "testbed spread | simulator p50 | ratio | within 5%? | simulator, no contention (ratio) |"
        + extra, "|---|---|---|---|---|---|---|---|---|" + ("---|" if micro else "")]
for topo in ("cpu-1p1d", "cpu-2p1d-tp2-to-tp1"):
    tb = [json.load(open(f"{out}/testbed-{topo}-{i}.json")) for i in range(1, repeats + 1)]
    sim = json.load(open(f"{out}/sim-{topo}-contention-on.json"))
    off = json.load(open(f"{out}/sim-{topo}-contention-off.json"))
    mic = json.load(open(f"{out}/sim-{topo}-micro-contention-on.json")) if micro else None
    for metric, key in (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms")):
        runs = [r[key]["p50"] for r in tb]
        t = statistics.median(runs)
        s, o = sim[key]["p50"], off[key]["p50"]
        ratio = s / t
        ok = "yes" if abs(ratio - 1) <= 0.05 else "no"
        spread = (max(runs) - min(runs)) / t
        rows.append(f"| {topo} | {metric} | {' / '.join(f'{x:.2f}' for x in runs)} | {t:.2f} | "
                    f"{spread:.1%} | {s:.2f} | {ratio:.3f} | {ok} | {o:.2f} ({o / t:.3f}) |"
                    + (f" {mic[key]['p50']:.2f} ({mic[key]['p50'] / t:.3f}) |" if micro else ""))
table = "\n".join(rows)
print(table)
open(f"{out}/fidelity.md", "w").write(table + "\n")
EOF
