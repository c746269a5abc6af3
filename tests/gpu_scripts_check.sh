#!/usr/bin/env bash
# The GPU check's measurement scripts in their CPU dry-run mode (ctest gpu_scripts_dry_run, label
# unit): scripts/gpu_layerwise.sh and scripts/gpu_fidelity.sh run their whole flow on cpu-1p1d
# with the tiny model, and their JSON is checked against the runs' own reports:
#   layerwise.json: four rows (50 GB/s and the transfer == prefill rate, each off and on), every
#     figure a finite number in range, the reduction on the on rows = 1 - TTFT on / TTFT off;
#     the equal rate = KV bytes per prompt / prefill ms, where the KV bytes are what the prompt
#     holds (tokens x layers x K,V x KV heads x head_dim x 4 bytes: fp32 on CPU ranks) and the
#     prefill ms the median lifecycle prefill time of run 50-off; the eq runs were shaped to it;
#   fidelity.json: TTFT and TPOT rows whose testbed p50 is the testbed report's, simulator p50 the
#     median of the seeds' reports, ratio their quotient;
#   a failing run makes gpu_layerwise.sh exit 1 with a message (--fault skip-record), and a bad
#   setting exits 2;
#   scripts/gpu_two_process.sh under this machine's mpirun (two CPU rank processes on cpu-1p1d):
#     two_process.json passed, every check held, its counts the report's; with --fault
#     skip-record it exits 1 naming the failure and writes no two_process.json; with
#     PDSIM_GPU_TWO_PROCESS_PREFILL_TP=2, three processes (TP 2 prefill -> TP 1 decode), every
#     check held and both prefill ranks' bytes counted (skipped, and said, where there is no
#     mpirun).
# Usage: tests/gpu_scripts_check.sh <pdsim binary>
set -uo pipefail
PDSIM_BIN=${1:?usage: gpu_scripts_check.sh <pdsim binary>}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/pdsim-gpu-scripts.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }
unset PDSIM_GPU_TEST_PDSIM
export PDSIM=$PDSIM_BIN

echo "== gpu_layerwise.sh (cpu dry run)"
PDSIM_GPU_LAYERWISE_BACKEND=cpu OUT=$TMP/lw bash "$ROOT/scripts/gpu_layerwise.sh" >"$TMP/lw.out" 2>&1
rc=$?
cat "$TMP/lw.out"
[ $rc -eq 0 ] || bad "gpu_layerwise.sh exited $rc"
echo "== gpu_fidelity.sh (cpu dry run)"
PDSIM_GPU_FIDELITY_BACKEND=cpu OUT=$TMP/fid bash "$ROOT/scripts/gpu_fidelity.sh" >"$TMP/fid.out" 2>&1
rc=$?
cat "$TMP/fid.out"
[ $rc -eq 0 ] || bad "gpu_fidelity.sh exited $rc"

if [ $fail -eq 0 ]; then
  python3 - "$TMP" <<'EOF' || fail=1
import json, math, statistics, sys
tmp = sys.argv[1]
errors = []
def check(cond, what):
    if not cond:
        errors.append(what)
def num(x, lo=-math.inf, hi=math.inf):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and lo <= x <= hi

lw = json.load(open(f"{tmp}/lw/layerwise.json"))
rows = lw.get("rows", [])
check([(r.get("rate"), r.get("layerwise")) for r in rows] ==
      [("50 GB/s", "off"), ("50 GB/s", "on"), ("transfer == prefill", "off"),
       ("transfer == prefill", "on")], f"layerwise rows: {[(r.get('rate'), r.get('layerwise')) for r in rows]}")
for r in rows:
    tag = f"{r.get('rate')} {r.get('layerwise')}"
    check(num(r.get("ttft_p50_ms"), 1e-6), f"{tag}: ttft_p50_ms {r.get('ttft_p50_ms')}")
    check(num(r.get("exposed_fraction"), 0, 1), f"{tag}: exposed_fraction {r.get('exposed_fraction')}")
    check(num(r.get("layer_latency_p50_us"), 1e-9), f"{tag}: layer_latency_p50_us {r.get('layer_latency_p50_us')}")
    check(r.get("requests_completed") == lw["requests"] and r.get("requests_failed") == 0,
          f"{tag}: completed {r.get('requests_completed')} of {lw['requests']}")
for off, on in ((rows[0], rows[1]), (rows[2], rows[3])) if len(rows) == 4 else ():
    red = on.get("ttft_reduction_vs_off")
    check(num(red) and abs(red - (1 - on["ttft_p50_ms"] / off["ttft_p50_ms"])) < 1e-9,
          f"{on['rate']}: reduction {red}")
    check(isinstance(on.get("exposed_target_met"), bool), f"{on['rate']}: exposed_target_met")
if len(rows) == 4:
    check(isinstance(rows[3].get("reduction_target_met"), bool), "reduction_target_met")
eq = lw.get("equal_rate", {})
rep = json.load(open(f"{tmp}/lw/lw-50-off.json"))
m = rep["config"]["model"]
prompt_kv = lw["prompt_tokens"] * m["num_layers"] * 2 * m["num_kv_heads"] * m["head_dim"] * 4
check(m["num_layers"] == lw["layers"], f"layers {m['num_layers']} != {lw['layers']}")
check(eq.get("kv_bytes_per_prompt") == prompt_kv, f"kv bytes {eq.get('kv_bytes_per_prompt')} != {prompt_kv}")
pre = statistics.median(x["prefill_end_ms"] - x["prefill_start_ms"] for x in rep["lifecycle"])
check(num(eq.get("prefill_ms")) and abs(eq["prefill_ms"] - pre) <= 1e-3 * pre,
      f"prefill ms {eq.get('prefill_ms')} != {pre}")
want = prompt_kv / (pre * 1e-3) / 1e9
check(num(eq.get("gbps")) and abs(eq["gbps"] / want - 1) < 1e-3, f"equal rate {eq.get('gbps')} != {want}")
for lwmode in ("off", "on"):
    g = json.load(open(f"{tmp}/lw/lw-eq-{lwmode}.json"))["config"]["shaping"]["link_gbps"]
    check(abs(g / want - 1) < 1e-3, f"eq-{lwmode} shaped at {g} GB/s, not {want}")
    g = json.load(open(f"{tmp}/lw/lw-50-{lwmode}.json"))["config"]["shaping"]["link_gbps"]
    check(g == 50, f"50-{lwmode} shaped at {g} GB/s")

fid = json.load(open(f"{tmp}/fid/fidelity.json"))
tb = json.load(open(f"{tmp}/fid/fid-testbed.json"))
sims = [json.load(open(f"{tmp}/fid/fid-sim-seed{s}.json")) for s in (1, 2, 3)]
frows = fid.get("rows", [])
check([r.get("metric") for r in frows] == ["TTFT", "TPOT"], f"fidelity rows {frows}")
for r, key in zip(frows, ("ttft_ms", "tpot_ms")):
    check(r.get("testbed_p50_ms") == tb[key]["p50"], f"{key}: testbed {r.get('testbed_p50_ms')}")
    s = statistics.median(x[key]["p50"] for x in sims)
    check(r.get("simulator_p50_ms") == s, f"{key}: simulator {r.get('simulator_p50_ms')} != {s}")
    check(num(r.get("ratio"), 1e-9) and abs(r["ratio"] - s / tb[key]["p50"]) < 1e-9,
          f"{key}: ratio {r.get('ratio')}")
    check(isinstance(r.get("within_target"), bool), f"{key}: within_target")
check(tb["requests_completed"] == fid["sample"] and tb["requests_failed"] == 0,
      f"testbed completed {tb['requests_completed']} of {fid['sample']}")
for e in errors:
    print("FAIL:", e)
print(f"json checks: {len(errors)} failed")
sys.exit(1 if errors else 0)
EOF
fi

echo "== gpu_layerwise.sh with a failing run (--fault skip-record)"
PDSIM_GPU_LAYERWISE_BACKEND=cpu PDSIM_GPU_LAYERWISE_ARGS="--fault skip-record" OUT=$TMP/lwf \
  bash "$ROOT/scripts/gpu_layerwise.sh" >"$TMP/lwf.out" 2>&1
rc=$?
[ $rc -eq 1 ] || bad "a failing run: exit $rc, not 1"
grep -q 'gpu_layerwise.sh: run 50-off failed (exit 1' "$TMP/lwf.out" || bad "no failure message"
[ -e "$TMP/lwf/layerwise.json" ] && bad "a failing run wrote layerwise.json"
echo "== gpu_two_process.sh (cpu dry run, mpirun -np 2)"
if command -v mpirun >/dev/null; then
  PDSIM_GPU_TWO_PROCESS_BACKEND=cpu OUT=$TMP/tp bash "$ROOT/scripts/gpu_two_process.sh" \
    >"$TMP/tp.out" 2>&1
  rc=$?
  cat "$TMP/tp.out"
  [ $rc -eq 0 ] || bad "gpu_two_process.sh exited $rc"
  python3 - "$TMP/tp" <<'EOF' || bad "two_process.json does not agree with its report"
import json, sys
d = sys.argv[1]
j = json.load(open(f"{d}/two_process.json"))
r = json.load(open(f"{d}/two_process-report.json"))
errors = []
if not j["passed"] or not all(c["ok"] for c in j["checks"]) or len(j["checks"]) < 9:
    errors.append(f"passed {j['passed']}, checks {j['checks']}")
if r["config"]["ranks"] != 2 or r["config"]["transport"] != "mpi":
    errors.append(f"not two processes over mpi: {r['config']['ranks']} {r['config']['transport']}")
if r["requests_completed"] != j["requests"] or j["ttft_p50_ms"] != r["ttft_ms"]["p50"]:
    errors.append("figures differ from the report")
for e in errors:
    print("FAIL:", e)
sys.exit(1 if errors else 0)
EOF
  PDSIM_GPU_TWO_PROCESS_BACKEND=cpu PDSIM_GPU_TWO_PROCESS_ARGS="--fault skip-record" \
    OUT=$TMP/tpf bash "$ROOT/scripts/gpu_two_process.sh" >"$TMP/tpf.out" 2>&1
  rc=$?
  [ $rc -eq 1 ] || bad "gpu_two_process.sh, a failing run: exit $rc, not 1"
  grep -q 'gpu_two_process.sh: the two-process run failed (exit 1): error: ' "$TMP/tpf.out" \
    || bad "gpu_two_process.sh, a failing run: no failure message"
  [ -e "$TMP/tpf/two_process.json" ] && bad "gpu_two_process.sh: a failing run wrote its JSON"
  echo "== gpu_two_process.sh (cpu dry run, TP 2 -> 1, mpirun -np 3)"
  PDSIM_GPU_TWO_PROCESS_BACKEND=cpu PDSIM_GPU_TWO_PROCESS_PREFILL_TP=2 OUT=$TMP/tp2 \
    bash "$ROOT/scripts/gpu_two_process.sh" >"$TMP/tp2.out" 2>&1
  rc=$?
  cat "$TMP/tp2.out"
  [ $rc -eq 0 ] || bad "gpu_two_process.sh (TP 2) exited $rc"
  python3 - "$TMP/tp2" <<'EOF' || bad "two_process.json (TP 2) does not agree with its report"
import json, sys
d = sys.argv[1]
j = json.load(open(f"{d}/two_process.json"))
r = json.load(open(f"{d}/two_process-report.json"))
errors = []
if not j["passed"] or not all(c["ok"] for c in j["checks"]) or j["ranks"] != 3:
    errors.append(f"passed {j['passed']}, ranks {j['ranks']}, checks {j['checks']}")
sent = [x["stats"]["sender"]["bytes"] for x in r["ranks"] if x["role"] == "prefill"]
if r["config"]["ranks"] != 3 or len(sent) != 2 or sum(sent) != r["transfer"]["bytes"]:
    errors.append(f"not TP 2 -> 1 over 3 processes: {r['config']['ranks']} ranks, sent {sent}")
for e in errors:
    print("FAIL:", e)
sys.exit(1 if errors else 0)
EOF
else
  echo "SKIPPED: no mpirun on PATH"
fi
echo "== bad setting"
PDSIM_GPU_LAYERWISE_BACKEND=cpu PDSIM_GPU_LAYERWISE_TOKENS=x OUT=$TMP/lwb \
  bash "$ROOT/scripts/gpu_layerwise.sh" >"$TMP/lwb.out" 2>&1
rc=$?
[ $rc -eq 2 ] || bad "PDSIM_GPU_LAYERWISE_TOKENS=x: exit $rc, not 2"
grep -q 'PDSIM_GPU_LAYERWISE_TOKENS=x' "$TMP/lwb.out" || bad "the message does not name the setting"
PDSIM_GPU_FIDELITY_BACKEND=gpu OUT=$TMP/fidb bash "$ROOT/scripts/gpu_fidelity.sh" \
  >"$TMP/fidb.out" 2>&1
rc=$?
[ $rc -eq 2 ] || bad "PDSIM_GPU_FIDELITY_BACKEND=gpu: exit $rc, not 2"
PDSIM_GPU_TWO_PROCESS_BACKEND=cpu PDSIM_GPU_TWO_PROCESS_RUN_S=-1 OUT=$TMP/tpb \
  bash "$ROOT/scripts/gpu_two_process.sh" >"$TMP/tpb.out" 2>&1
rc=$?
[ $rc -eq 2 ] || bad "PDSIM_GPU_TWO_PROCESS_RUN_S=-1: exit $rc, not 2"
grep -q 'PDSIM_GPU_TWO_PROCESS_RUN_S=-1' "$TMP/tpb.out" || bad "the message does not name the setting"
if [ $fail -eq 0 ]; then echo "PASS"; else echo "FAILED"; fi
exit $fail
