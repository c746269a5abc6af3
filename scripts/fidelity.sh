#!/usr/bin/env bash
# Simulator fidelity against the CPU testbed on this machine (docs/fidelity.md):
#   1. calibrate:
#      CALIBRATE=1: pdsim calibrate's microbenchmark only (tiny, TP 1 and 2, 1 thread per rank:
#        what both topologies run here) -> $OUT/cost.json;
#      CALIBRATE=testbed (default): that too (it supplies what the testbed runs have no forwards
#        of, e.g. TP-2 decode), then per topology CAL_RUNS testbed runs on other requests than the
#        validation's (seeds CAL_SEED, CAL_SEED+1, ...) with --timeline, and
#        pdsim calibrate --from-timeline over that topology's timelines ->
#        $OUT/cost-testbed-TOPOLOGY.json (fits of the mean forward, interference between
#        instances, forward-time noise), and over all of them -> $OUT/cost-testbed.json (pooled);
#      CALIBRATE=refit: reuse $OUT/cost.json and the calibration timelines in $OUT, and fit
#        again (after a change to pdsim calibrate);
#      CALIBRATE=0: reuse the cost files in $OUT;
#   2. for cpu-1p1d and cpu-2p1d-tp2-to-tp1: the testbed under mpirun (REPEATS times, seed 1),
#      then pdsim simulate on the same topology, model, trace sample, caps and time scale, with
#      --noise-seed 1..SIM_SEEDS (the simulator's run-to-run spread, as the testbed's repeats);
#      references: the same with --cost-noise off, the pooled file and the microbenchmark file;
#   3. a markdown table of median TTFT / TPOT: testbed (median of the repeats and their range),
#      simulator (median of the seeds and their range), ratio, within 5%?  -> $OUT/fidelity.md.
# Env: PDSIM (binary, default build/fidelity/sim/pdsim), OUT (out/fidelity), SAMPLE (96),
# SCALE (0.012), REPEATS (5), SIM_SEEDS (5), CALIBRATE (testbed | 1 | 0), CAL_REPEATS (3),
# CAL_RUNS (3), CAL_SEED (2), BIND (core | none), TESTBED (run | reuse: keep $OUT's validation
# runs, e.g. with CALIBRATE=refit to redo only the simulator side).
# About 13 minutes on the 2-core machine (CALIBRATE=1: about 8).
set -euo pipefail
cd "$(dirname "$0")/.."
PDSIM=${PDSIM:-build/fidelity/sim/pdsim}
OUT=${OUT:-out/fidelity}
SAMPLE=${SAMPLE:-96}
SCALE=${SCALE:-0.012}
REPEATS=${REPEATS:-5}
SIM_SEEDS=${SIM_SEEDS:-5}
CALIBRATE=${CALIBRATE:-testbed}
CAL_REPEATS=${CAL_REPEATS:-3}
CAL_RUNS=${CAL_RUNS:-3}
CAL_SEED=${CAL_SEED:-2}
TRACE=${TRACE:-data/traces/mooncake_conversation.jsonl}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The same requests on both sides: sample, seed, caps (the testbed's defaults), time scale.
CAPS=(--time-scale "$SCALE" --max-input-len 1024 --max-output-len 32)
WORKLOAD=(--trace "$TRACE" --sample "$SAMPLE" --seed 1 "${CAPS[@]}")
TOPOS=(cpu-1p1d cpu-2p1d-tp2-to-tp1)
# Rank placement. BIND=core (default): ranks round-robin over the cores, each bound to one (5
# ranks on 2 cores: 0, 2, 4 on core 0 and 1, 3 on core 1, so each TP pair spans both cores);
# OpenMPI binds only when ranks <= cores unless told, and unbound ranks let the kernel move them,
# which changes from run to run (docs/fidelity.md section 5). BIND=none: OpenMPI's default.
BIND=${BIND:-core}
TESTBED=${TESTBED:-run}
BINDING=()
[ "$BIND" = core ] && BINDING=(--map-by core --bind-to core:overload-allowed)
testbed() {  # testbed TOPOLOGY OUTPUT_PREFIX ARGS...
    local yaml=topology/examples/$1.yaml prefix=$2
    shift 2
    local np
    np=$(awk '/^world_size:/ {print $2}' "$yaml")
    mpirun --oversubscribe -np "$np" "${BINDING[@]}" --mca pml ob1 --mca btl self,vader,tcp \
        "$PDSIM" testbed --topology "$yaml" --mode disagg "$@" --quiet \
        --report "$prefix.json" > "$prefix.log" 2>&1
}
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
echo "machine: $(nproc) cores, $(uname -m); binding $BIND; start $(date -u +%FT%TZ), load $(loadavg)" |
    tee -a "$OUT/machine.txt"

if { [ "$CALIBRATE" != 0 ] && [ "$CALIBRATE" != refit ]; } || [ ! -f "$OUT/cost.json" ]; then
    echo "== calibrate (load $(loadavg))"
    "$PDSIM" calibrate --model tiny --tp 1,2 --threads 1 --transport none \
        --repeats "$CAL_REPEATS" --out "$OUT/cost.json" > "$OUT/calibrate.log" 2>&1
fi
TESTBED_COST=0
if [ "$CALIBRATE" = testbed ] || [ "$CALIBRATE" = refit ] ||
    { [ "$CALIBRATE" = 0 ] && [ -f "$OUT/cost-testbed.json" ]; }; then
    TESTBED_COST=1
fi
if [ "$CALIBRATE" = testbed ] || [ "$CALIBRATE" = refit ]; then
    # Other requests than the validation runs' (seed 1): the fit must predict runs it has not seen.
    all=()
    for topo in "${TOPOS[@]}"; do
        timelines=()
        for i in $(seq 1 "$CAL_RUNS"); do
            seed=$((CAL_SEED + i - 1))
            if [ "$CALIBRATE" = testbed ]; then
                echo "== calibration testbed $topo run $i (seed $seed; load before $(loadavg))"
                testbed "$topo" "$OUT/caltestbed-$topo-$i" --trace "$TRACE" --sample "$SAMPLE" \
                    --seed "$seed" "${CAPS[@]}" --timeline "$OUT/caltimeline-$topo-$i.json"
            fi
            timelines+=("$OUT/caltimeline-$topo-$i.json")
        done
        all+=("${timelines[@]}")
        echo "== calibrate --from-timeline ($topo)"
        "$PDSIM" calibrate --from-timeline "$(IFS=,; echo "${timelines[*]}")" \
            --base "$OUT/cost.json" --model tiny --out "$OUT/cost-testbed-$topo.json" \
            > "$OUT/calibrate-testbed-$topo.log" 2>&1
    done
    echo "== calibrate --from-timeline (pooled)"
    "$PDSIM" calibrate --from-timeline "$(IFS=,; echo "${all[*]}")" --base "$OUT/cost.json" \
        --model tiny --out "$OUT/cost-testbed.json" > "$OUT/calibrate-testbed.log" 2>&1
fi

simulate() {  # simulate TOPOLOGY COST OUTPUT_PREFIX ARGS...
    local topo=$1 cost=$2 prefix=$3
    shift 3
    "$PDSIM" simulate --topology "topology/examples/$topo.yaml" --mode disagg "${WORKLOAD[@]}" \
        --cost-model "$cost" --prefix-cache off --kv-admission full \
        --max-decode-kv-tokens 2048 "$@" --quiet --report "$prefix.json" > "$prefix.log" 2>&1
}
for topo in "${TOPOS[@]}"; do
    np=$(awk '/^world_size:/ {print $2}' "topology/examples/$topo.yaml")
    for i in $(seq 1 "$REPEATS"); do
        [ "$TESTBED" = reuse ] && [ -f "$OUT/testbed-$topo-$i.json" ] && continue
        echo "== testbed $topo run $i (mpirun -np $np; load before $(loadavg))"
        testbed "$topo" "$OUT/testbed-$topo-$i" "${WORKLOAD[@]}"
        echo "   load after $(loadavg)" | tee -a "$OUT/machine.txt"
    done
    main=$OUT/cost.json
    [ "$TESTBED_COST" = 1 ] && main=$OUT/cost-testbed-$topo.json
    echo "== simulate $topo ($main, noise seeds 1..$SIM_SEEDS; references)"
    for s in $(seq 1 "$SIM_SEEDS"); do
        simulate "$topo" "$main" "$OUT/sim-$topo-seed$s" --noise-seed "$s"
    done
    simulate "$topo" "$main" "$OUT/sim-$topo-nonoise" --cost-noise off
    simulate "$topo" "$OUT/cost.json" "$OUT/sim-$topo-micro"
    if [ "$TESTBED_COST" = 1 ]; then
        for s in $(seq 1 "$SIM_SEEDS"); do
            simulate "$topo" "$OUT/cost-testbed.json" "$OUT/sim-$topo-pooled-seed$s" --noise-seed "$s"
        done
    fi
done
echo "end $(date -u +%FT%TZ), load $(loadavg)" | tee -a "$OUT/machine.txt"

python3 - "$OUT" "$REPEATS" "$SIM_SEEDS" "$TESTBED_COST" <<'EOF'
import json, statistics, sys
out, repeats, seeds, testbed_cost = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
load = lambda p: json.load(open(f"{out}/{p}.json"))
head = ("| topology | metric | testbed p50 of each run | testbed p50 (median of runs) | testbed spread "
        "| simulator p50 (median of seeds) | simulator range | ratio | within 5%? "
        "| deterministic (ratio) | microbenchmark calibration (ratio) |"
        + (" pooled calibration (ratio) |" if testbed_cost else ""))
rows = [head, "|" + "---|" * (head.count("|") - 1)]
for topo in ("cpu-1p1d", "cpu-2p1d-tp2-to-tp1"):
    tb = [load(f"testbed-{topo}-{i}") for i in range(1, repeats + 1)]
    sim = [load(f"sim-{topo}-seed{s}") for s in range(1, seeds + 1)]
    det, mic = load(f"sim-{topo}-nonoise"), load(f"sim-{topo}-micro")
    pooled = [load(f"sim-{topo}-pooled-seed{s}") for s in range(1, seeds + 1)] if testbed_cost else []
    for metric, key in (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms")):
        runs = [r[key]["p50"] for r in tb]
        t = statistics.median(runs)
        sims = [r[key]["p50"] for r in sim]
        s = statistics.median(sims)
        ratio = s / t
        ok = "yes" if abs(ratio - 1) <= 0.05 else "no"
        row = (f"| {topo} | {metric} | {' / '.join(f'{x:.2f}' for x in runs)} | {t:.2f} | "
               f"{(max(runs) - min(runs)) / t:.1%} | {s:.2f} | {min(sims):.2f}-{max(sims):.2f} | "
               f"{ratio:.3f} | {ok} | {det[key]['p50']:.2f} ({det[key]['p50'] / t:.3f}) | "
               f"{mic[key]['p50']:.2f} ({mic[key]['p50'] / t:.3f}) |")
        if testbed_cost:
            p = statistics.median(r[key]["p50"] for r in pooled)
            row += f" {p:.2f} ({p / t:.3f}) |"
        rows.append(row)
table = "\n".join(rows)
print(table)
open(f"{out}/fidelity.md", "w").write(table + "\n")
EOF
