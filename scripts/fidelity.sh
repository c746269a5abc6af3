#!/usr/bin/env bash
# Simulator fidelity against the CPU testbed on this machine (docs/fidelity.md):
#   1. pdsim calibrate once (tiny, TP 1 and 2, 1 thread per rank: what both topologies run here);
#   2. for cpu-1p1d and cpu-2p1d-tp2-to-tp1: the testbed under mpirun (REPEATS times), then
#      pdsim simulate on the same topology, model, trace sample, caps and time scale with the
#      cost file (core contention on, and off for reference);
#   3. a markdown table of median TTFT / TPOT: testbed (median of the repeats, and their range),
#      simulator, ratio, within 5%?  -> $OUT/fidelity.md (and stdout).
# Env: PDSIM (binary, default build/fidelity/sim/pdsim), OUT (out/fidelity), SAMPLE (96),
# SCALE (0.012), REPEATS (3), CALIBRATE (1; 0 reuses $OUT/cost.json), CAL_REPEATS (3).
# About 6 minutes on the 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PDSIM=${PDSIM:-build/fidelity/sim/pdsim}
OUT=${OUT:-out/fidelity}
SAMPLE=${SAMPLE:-96}
SCALE=${SCALE:-0.012}
REPEATS=${REPEATS:-3}
CALIBRATE=${CALIBRATE:-1}
CAL_REPEATS=${CAL_REPEATS:-3}
TRACE=${TRACE:-../shared/data/traces/mooncake_conversation.jsonl}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The same requests on both sides: sample, seed, caps (the testbed's defaults), time scale.
WORKLOAD=(--trace "$TRACE" --sample "$SAMPLE" --seed 1 --time-scale "$SCALE"
          --max-input-len 1024 --max-output-len 32)
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
echo "machine: $(nproc) cores, $(uname -m); start $(date -u +%FT%TZ), load $(loadavg)" |
    tee "$OUT/machine.txt"

if [ "$CALIBRATE" = 1 ] || [ ! -f "$OUT/cost.json" ]; then
    echo "== calibrate (load $(loadavg))"
    "$PDSIM" calibrate --model tiny --tp 1,2 --threads 1 --transport none \
        --repeats "$CAL_REPEATS" --out "$OUT/cost.json" > "$OUT/calibrate.log" 2>&1
fi

for topo in cpu-1p1d cpu-2p1d-tp2-to-tp1; do
    yaml=topology/examples/$topo.yaml
    np=$(awk '/^world_size:/ {print $2}' "$yaml")
    for i in $(seq 1 "$REPEATS"); do
        echo "== testbed $topo run $i (mpirun -np $np; load before $(loadavg))"
        mpirun --oversubscribe -np "$np" --mca pml ob1 --mca btl self,vader,tcp \
            "$PDSIM" testbed --topology "$yaml" --mode disagg "${WORKLOAD[@]}" --quiet \
            --report "$OUT/testbed-$topo-$i.json" > "$OUT/testbed-$topo-$i.log" 2>&1
        echo "   load after $(loadavg)" | tee -a "$OUT/machine.txt"
    done
    for cont in on off; do
        echo "== simulate $topo (cpu contention $cont)"
        "$PDSIM" simulate --topology "$yaml" --mode disagg "${WORKLOAD[@]}" \
            --cost-model "$OUT/cost.json" --prefix-cache off --kv-admission full \
            --max-decode-kv-tokens 2048 --cpu-contention "$cont" --quiet \
            --report "$OUT/sim-$topo-contention-$cont.json" > "$OUT/sim-$topo-$cont.log" 2>&1
    done
done
echo "end $(date -u +%FT%TZ), load $(loadavg)" | tee -a "$OUT/machine.txt"

python3 - "$OUT" "$REPEATS" <<'EOF'
import json, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
rows = ["| topology | metric | testbed p50 of each run | testbed p50 (median of runs) | "
        "testbed spread | simulator p50 | ratio | within 5%? | simulator, no contention (ratio) |",
        "|---|---|---|---|---|---|---|---|---|"]
for topo in ("cpu-1p1d", "cpu-2p1d-tp2-to-tp1"):
    tb = [json.load(open(f"{out}/testbed-{topo}-{i}.json")) for i in range(1, repeats + 1)]
    sim = json.load(open(f"{out}/sim-{topo}-contention-on.json"))
    off = json.load(open(f"{out}/sim-{topo}-contention-off.json"))
    for metric, key in (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms")):
        runs = [r[key]["p50"] for r in tb]
        t = statistics.median(runs)
        s, o = sim[key]["p50"], off[key]["p50"]
        ratio = s / t
        ok = "yes" if abs(ratio - 1) <= 0.05 else "no"
        spread = (max(runs) - min(runs)) / t
        rows.append(f"| {topo} | {metric} | {' / '.join(f'{x:.2f}' for x in runs)} | {t:.2f} | "
                    f"{spread:.1%} | {s:.2f} | {ratio:.3f} | {ok} | {o:.2f} ({o / t:.3f}) |")
table = "\n".join(rows)
print(table)
open(f"{out}/fidelity.md", "w").write(table + "\n")
EOF
