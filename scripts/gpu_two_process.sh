#!/usr/bin/env bash
# Two processes on one GPU under mpirun (docs/testbed.md section 12): the only disaggregated layout
# a one-GPU machine allows, since NCCL refuses two ranks on one GPU. Runs
#   mpirun -np 2 pdsim testbed --backend cuda --mode both --topology gpu-1p1d --model tiny ...
# so the prefill rank and the decode rank are two processes computing on GPU 0, the control
# transport is mpi and the KV goes over cuda_ipc writes between the processes (the decode process's
# pool opened by the prefill process through CUDA IPC memory handles, which threads of one process
# never exercise). Then it checks the report:
#   - every request completed in both runs (disaggregated and colocated), none failed or lost;
#   - 0 ordering violations, over at least one checked layer per request and layer;
#   - outputs_match (disaggregated tokens == colocated tokens) and KV digest parity;
#   - the prefill rank sent and the decode rank received the same KV bytes (> 0), for every request;
#   - the run was what it claims: 2 ranks, control transport mpi, data transport cuda_ipc (CPU
#     dry run: none), each rank on a GPU (ranks[i].device).
# With PDSIM_GPU_TWO_PROCESS_PREFILL_TP=2: three processes, gpu-1p1d-tp2-to-tp1 (a TP-2 prefill
# instance, both its ranks on GPU 0, and a TP-1 decode instance on it too): GPU tensor parallelism
# under mpirun (the TP group's partials exchanged over MPI) and heterogeneous TP (each prefill
# rank writes its KV heads; both add to the arrival words); the same checks, per prefill rank.
# Writes $OUT/two_process.json (each check, the figures), $OUT/two_process.md (one table row) and
# the run's report and log; prints one line per check.
#
# CPU dry run (PDSIM_GPU_TWO_PROCESS_BACKEND=cpu): the same on cpu-1p1d with CPU ranks, KV over
# the mpi transport (--data-transport none), under this machine's mpirun (TP 2: the generator's
# cpu --pd 1:1 --prefill-tp 2 topology, written to $OUT); proves the launch and the checks here
# (tests/gpu_scripts_check.sh); it says nothing about CUDA IPC.
#
# Exit: 0 when the run passed every check; 1 with a message when the run failed or a check did
# not hold (the run's exit status and its log's last error are printed); 2 on bad settings.
# Env: PDSIM_GPU_TEST_PDSIM (the pdsim command as shell words, as scripts/gpu_check.sh exports
#      it) or PDSIM (a binary; default build/gpu/sim/pdsim); PDSIM_GPU_MPIRUN (the launcher as
#      shell words; scripts/gpu_check.sh sets it to the bundle's Open MPI) or mpirun on PATH;
#      OUT (out/two-process-gpu); PDSIM_GPU_TWO_PROCESS_BACKEND (cuda | cpu),
#      _PREFILL_TP (1 | 2), _REQUESTS (8), _RUN_S (the run's timeout, 90), _ARGS (extra testbed
#      arguments).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
me=gpu_two_process.sh
BACKEND=${PDSIM_GPU_TWO_PROCESS_BACKEND:-cuda}
PREFILL_TP=${PDSIM_GPU_TWO_PROCESS_PREFILL_TP:-1}
case $PREFILL_TP in
  1|2) NP=$((PREFILL_TP + 1)) ;;
  *) echo "$me: PDSIM_GPU_TWO_PROCESS_PREFILL_TP=$PREFILL_TP: 1 or 2" >&2; exit 2 ;;
esac
case $BACKEND in
  cuda) TOPO=gpu-1p1d; DATA=cuda_ipc; BACKEND_ARGS=(--backend cuda) ;;
  cpu) TOPO=cpu-1p1d; DATA=none; BACKEND_ARGS=(--backend cpu --data-transport none) ;;
  *) echo "$me: PDSIM_GPU_TWO_PROCESS_BACKEND=$BACKEND: cuda or cpu" >&2; exit 2 ;;
esac
REQUESTS=${PDSIM_GPU_TWO_PROCESS_REQUESTS:-8}
RUN_S=${PDSIM_GPU_TWO_PROCESS_RUN_S:-90}
for v in REQUESTS RUN_S; do
  if ! [[ ${!v} =~ ^[1-9][0-9]*$ ]]; then
    echo "$me: PDSIM_GPU_TWO_PROCESS_$v=${!v}: a positive integer" >&2
    exit 2
  fi
done
if [ -n "${PDSIM_GPU_TEST_PDSIM:-}" ]; then
  eval "PD=($PDSIM_GPU_TEST_PDSIM)"
else
  PD=("${PDSIM:-build/gpu/sim/pdsim}")
fi
if [ -n "${PDSIM_GPU_MPIRUN:-}" ]; then
  eval "MPIRUN=($PDSIM_GPU_MPIRUN)"
elif command -v mpirun >/dev/null; then
  MPIRUN=(mpirun)
else
  echo "$me: no mpirun on PATH and PDSIM_GPU_MPIRUN is not set (scripts/gpu_bundle.sh packs" \
    "Open MPI's launcher into .gpu/ompi; scripts/gpu_check.sh sets it)" >&2
  exit 1
fi
OUT_DIR=${OUT:-out/two-process-gpu}
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
REPORT=$OUT_DIR/two_process-report.json
LOG=$OUT_DIR/two_process.log
rm -f "$REPORT" "$LOG" "$OUT_DIR/two_process.json" "$OUT_DIR/two_process.md"
if [ "$PREFILL_TP" = 2 ]; then
  if [ "$BACKEND" = cuda ]; then
    TOPO=gpu-1p1d-tp2-to-tp1
  else
    TOPO=$OUT_DIR/cpu-1p1d-tp2-to-tp1.yaml
    python3 scripts/topology/gen_topology.py cpu --pd 1:1 --prefill-tp 2 --cpus 0 \
      --name cpu-1p1d-tp2-to-tp1 --out "$TOPO" || exit 1
  fi
fi
# shellcheck disable=SC2206
EXTRA=(${PDSIM_GPU_TWO_PROCESS_ARGS:-})
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One node: shared memory between the two processes (no network needed), backed by a file in
# TMPDIR (a container's /dev/shm may be tiny or absent); no binding, so both may use the GPU
# machine's cores freely; no single-copy mechanism (CMA needs ptrace rights that containers often
# withhold).
# shellcheck disable=SC2054  # self,vader is one argument (Open MPI's list of BTLs)
cmd=("${MPIRUN[@]}" -np "$NP" --oversubscribe --bind-to none --mca pml ob1 --mca btl "self,vader"
     --mca btl_vader_single_copy_mechanism none
     --mca btl_vader_backing_directory "${TMPDIR:-/tmp}"
     "${PD[@]}" testbed "${BACKEND_ARGS[@]}" --mode both --topology "$TOPO" --model tiny
     --transport mpi --synthetic "$REQUESTS" --max-input-len 128 --max-output-len 16
     --report "$REPORT" "${EXTRA[@]}")
echo "== $me ($BACKEND): ${cmd[*]}"
start=$SECONDS
timeout -k 5 "$RUN_S" "${cmd[@]}" >"$LOG" 2>&1
rc=$?
wall=$((SECONDS - start))
tail -25 "$LOG"
if [ $rc -ne 0 ]; then
  why="exit $rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="timed out after $RUN_S s"
  msg=$(grep -m1 -o 'error: .*' "$LOG" || grep -m1 -v -e '^\s*$' -e '^--*$' "$LOG")
  echo "$me: the two-process run failed ($why): ${msg:0:300}" >&2
  exit 1
fi
[ -s "$REPORT" ] || { echo "$me: the run exited 0 but wrote no report $REPORT" >&2; exit 1; }

python3 - "$REPORT" "$OUT_DIR" "$REQUESTS" "$DATA" "$BACKEND" "$wall" "$NP" <<'EOF'
import json, sys
report, out_dir, requests, data, backend, wall, np_ = sys.argv[1:8]
requests, np_ = int(requests), int(np_)
r = json.load(open(report))
checks = []
def check(what, ok, got):
    checks.append({"what": what, "ok": bool(ok), "got": got})

def counts(rep):
    return {k: rep.get(k) for k in ("requests_submitted", "requests_completed", "requests_failed",
                                    "requests_lost")}
for name, rep in (("disaggregated", r), ("colocated", r.get("colocated") or {})):
    c = counts(rep)
    check(f"{name}: every request completed", c["requests_submitted"] == requests
          and c["requests_completed"] == requests and c["requests_failed"] == 0
          and not c["requests_lost"], c)
o = r.get("ordering", {})
layers = r.get("transfer", {}).get("layer_latency_us", {}).get("count", 0)
check("0 ordering violations over checked layers", o.get("violations") == 0
      and o.get("checked_layers", 0) >= max(1, layers),
      {"violations": o.get("violations"), "checked_layers": o.get("checked_layers")})
check("outputs match (disaggregated == colocated tokens)", r.get("outputs_match") is True,
      {"outputs_match": r.get("outputs_match"),
       "mismatched": r.get("outputs_mismatched_requests")})
p = r.get("kv_parity", {})
check("KV digest parity (decode == prefill)", p.get("checked") == requests
      and not p.get("mismatched"), p)
ranks = r.get("ranks", [])
# Every prefill rank sends its share (its KV heads, with TP 2) of every request.
senders = [x["stats"].get("sender") or {} for x in ranks if x.get("role") == "prefill"]
receiver = next((x["stats"].get("receiver") for x in ranks if x.get("role") == "decode"), None) or {}
sent, got = sum(s.get("bytes", 0) for s in senders), receiver.get("bytes", 0)
check("KV bytes sent == received == the report's transfer bytes, > 0",
      sent > 0 and all(s.get("bytes", 0) > 0 for s in senders)
      and sent == got == r.get("transfer", {}).get("bytes"),
      {"sent": [s.get("bytes", 0) for s in senders], "received": got,
       "transfer": r.get("transfer", {}).get("bytes")})
check("every request's KV sent (by every prefill rank) and received",
      len(senders) == np_ - 1 and all(s.get("completed") == requests and not s.get("failed")
                                      for s in senders)
      and receiver.get("completed") == requests and not receiver.get("failed"),
      {"sent": [s.get("completed") for s in senders], "received": receiver.get("completed")})
cfg = r.get("config", {})
check(f"{np_} ranks, control over mpi (processes under mpirun)",
      cfg.get("ranks") == np_ and cfg.get("transport") == "mpi",
      {"ranks": cfg.get("ranks"), "transport": cfg.get("transport")})
check(f"data transport {data}", cfg.get("data_transport") == data,
      {"data_transport": cfg.get("data_transport")})
if data == "cuda_ipc":
    # cuda_ipc signals each layer's bytes into the decode process's arrival words; its compute
    # stream waits on them (cuStreamWaitValue64) before each request's decode forwards.
    waits = next((x["stats"].get("arrival_waits") for x in ranks if x.get("role") == "decode"),
                 None)
    check("the decode stream waited on every request's arrival words", waits == requests,
          {"arrival_waits": waits})
if backend == "cuda":
    devices = [x.get("device") for x in ranks]
    check(f"all {np_} ranks on one GPU", len(devices) == np_ and all(devices)
          and len(set(devices)) == 1, {"devices": devices})
    if np_ > 2:
        sliced = cfg.get("gpu_model", {}).get("sliced_reduction")
        check("the TP-invariant (sliced) forward on every rank", sliced is True,
              {"sliced_reduction": sliced})
        exchange = cfg.get("gpu_model", {}).get("tp_exchange")
        check("the TP partials over MPI (the TP ranks share the GPU: no NCCL)",
              exchange == "host", {"tp_exchange": exchange})
passed = all(c["ok"] for c in checks)
for c in checks:
    print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['what']}: {json.dumps(c['got'])}")
t = r.get("transfer", {})
summary = (f"{r.get('requests_completed')}/{requests} completed, "
           f"{o.get('violations')} violations over {o.get('checked_layers')} layers, outputs "
           f"{'match' if r.get('outputs_match') else 'DIFFER'}, {t.get('bytes', 0) / 2**20:.1f} MiB "
           f"over {cfg.get('data_transport')}, layer latency p50 "
           f"{t.get('layer_latency_us', {}).get('p50', float('nan')):.0f} us, {wall} s")
json.dump({"backend": backend, "topology": cfg.get("topology"), "ranks": np_,
           "requests": requests,
           "passed": passed, "summary": summary, "checks": checks, "wall_s": int(wall),
           "ttft_p50_ms": r.get("ttft_ms", {}).get("p50"),
           "tpot_p50_ms": r.get("tpot_ms", {}).get("p50")},
          open(f"{out_dir}/two_process.json", "w"), indent=1)
with open(f"{out_dir}/two_process.md", "w") as f:
    what = ("two processes" if np_ == 2 else
            f"{np_} processes (TP {np_ - 1} prefill -> TP 1 decode)")
    f.write(f"| testbed 1P1D, {what} on one GPU (mpirun, {cfg.get('topology')}) | "
            f"{'PASS' if passed else 'FAIL'}: {summary} |\n")
print(("PASS: " if passed else "FAIL: ") + summary)
sys.exit(0 if passed else 1)
EOF
rc=$?
[ $rc -eq 0 ] || echo "$me: a check did not hold ($OUT_DIR/two_process.json)" >&2
exit $rc
