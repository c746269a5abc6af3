#!/usr/bin/env bash
# Walks the bad inputs of docs/inputs.md against a built pdsim, as a hostile user would, and
# prints one row per case: the exit status, the seconds it took, and the first line of what pdsim
# said. Every case should exit 2 within a second or two, naming the file and line or the flag;
# the walk says "ok" when the status is the expected one and the message holds the expected text.
# Each case also has a test in CI (docs/inputs.md names it); this is the whole table in one run.
#
#   scripts/input_walk.sh [PDSIM]        PDSIM: the binary (default build/default/sim/pdsim)
#
# Exit 0 when every case is ok, 1 otherwise. Needs mkfifo and timeout; makes a temporary folder
# and removes it. Runs the testbed in-process (no mpirun), except the rank-count case.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
pdsim="${1:-$root/build/default/sim/pdsim}"
[ -x "$pdsim" ] || { echo "input_walk.sh: no pdsim at '$pdsim' (build first, or pass its path)" >&2; exit 2; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
bad=0

# case NAME EXPECTED_RC EXPECTED_TEXT -- COMMAND...
case_() {
  local name="$1" want_rc="$2" want_text="$3"; shift 4
  local t0 t1 rc out first verdict
  t0=$(date +%s.%N)
  out="$(cd "$tmp" && timeout 60 "$@" 2>&1 >/dev/null)"; rc=$?
  t1=$(date +%s.%N)
  first="$(printf '%s\n' "$out" | grep -v '^\s*$' | grep -m1 -E 'error|invalid|must|not|pdsim' \
           || printf '%s\n' "$out" | head -n1)"
  verdict=ok
  if [ "$rc" != "$want_rc" ] || { [ -n "$want_text" ] && ! printf '%s' "$out" | grep -qF -- "$want_text"; }; then
    verdict=FAIL; bad=1
  fi
  printf '%-4s | %-44s | %3s | %5.1f | %s\n' "$verdict" "$name" "$rc" \
    "$(echo "$t1 - $t0" | bc)" "$(printf '%s' "$first" | cut -c1-150)"
}

tb=("$pdsim" testbed --quiet --mode disagg --max-requests 4)
topo="$root/topology/examples/cpu-1p1d.yaml"
code_trace="$root/data/traces/azure_llm_code.csv"
sim=("$pdsim" simulate --max-requests 4 --topology "$root/topology/examples/gpu-1p1d.yaml")  # add --trace
simt=("$pdsim" simulate --max-requests 4 --trace "$code_trace")  # add --topology

# Traces.
for v in -3.0 -100.0 1e19 1e300 3.0 0 1073741824; do
  printf '{"timestamp": 0, "input_length": %s, "output_length": 4, "hash_ids": []}\n' "$v" \
    >"$tmp/len_$v.jsonl"
  case_ "jsonl input_length $v (testbed)" 2 "len_$v.jsonl:1" -- "${tb[@]}" --trace "$tmp/len_$v.jsonl"
  case_ "jsonl input_length $v (simulate)" 2 "len_$v.jsonl:1" -- "${sim[@]}" --trace "$tmp/len_$v.jsonl"
done
printf '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [18446744073709551615]}\n' \
  >"$tmp/hash.jsonl"
case_ "jsonl hash_ids 2^64-1" 2 "hash.jsonl:1" -- "${sim[@]}" --trace "$tmp/hash.jsonl"
printf '{"timestamp": 0, "input_length": 10, "output_length": 4, "hash_ids": [1, 2, 3]}\n' \
  >"$tmp/hash3.jsonl"
case_ "jsonl 3 hash_ids for 10 tokens" 2 "hash3.jsonl:1" -- "${sim[@]}" --trace "$tmp/hash3.jsonl"
for v in 1e14 99999999999999 -5 +5 3.0; do
  printf 'TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,%s,44\n' "$v" \
    >"$tmp/ctx_$v.csv"
  case_ "azure ContextTokens $v (testbed)" 2 "ctx_$v.csv:2" -- "${tb[@]}" --trace "$tmp/ctx_$v.csv"
  case_ "azure ContextTokens $v (simulate)" 2 "ctx_$v.csv:2" -- "${sim[@]}" --trace "$tmp/ctx_$v.csv"
done
head -c 100000000 /dev/zero | tr '\0' '7' >"$tmp/big_field"
{ printf 'TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,'; cat "$tmp/big_field"; \
  printf ',44\n'; } >"$tmp/big.csv"
rm -f "$tmp/big_field"
big_out="$("${sim[@]}" --trace "$tmp/big.csv" 2>&1 >/dev/null | wc -c)"
case_ "azure 100 MB field (stderr ${big_out} bytes)" 2 "big.csv:2" -- "${sim[@]}" --trace "$tmp/big.csv"
rm -f "$tmp/big.csv"
mkfifo "$tmp/fifo"
case_ "--trace a FIFO with no writer" 2 "fifo" -- "${tb[@]}" --trace "$tmp/fifo"
case_ "--topology a FIFO with no writer" 2 "fifo" -- "${tb[@]}" --topology "$tmp/fifo"
case_ "--trace /dev/zero" 2 "/dev/zero" -- "${sim[@]}" --trace /dev/zero
case_ "--trace a directory" 2 "$tmp" -- "${sim[@]}" --trace "$tmp"
case_ "--cost-model /dev/zero" 2 "/dev/zero" -- "${sim[@]}" --trace "$code_trace" --cost-model /dev/zero

# Topology and model files.
cp "$root/topology/examples/cpu-1p1d.yaml" "$tmp/two.yaml"
printf -- '---\nname: second\n' >>"$tmp/two.yaml"
case_ "topology with two YAML documents" 2 "two.yaml" -- "${simt[@]}" --topology "$tmp/two.yaml"
sed 's/^name: .*/name: "n\xc0\xaf"/' "$root/topology/examples/cpu-1p1d.yaml" >"$tmp/utf8.yaml"
case_ "topology name with invalid UTF-8" 2 "UTF-8" -- "${simt[@]}" --topology "$tmp/utf8.yaml"
printf 'base: tiny\nnum_layers: 100000000\n' >"$tmp/huge.yaml"
case_ "model num_layers 100000000" 2 "huge.yaml" -- "${sim[@]}" --trace "$code_trace" --model "$tmp/huge.yaml"
case_ "--model ''" 2 "--model" -- "${tb[@]}" --model ''

# Flags.
case_ "--transport-fault delay" 2 "--transport-fault" -- "${tb[@]}" --transport-fault delay
case_ "--transport-fault ';;;'" 2 "--transport-fault" -- "${tb[@]}" --transport-fault ';;;'
case_ "--transport-fault bad, --mode both" 2 "--transport-fault" -- \
  "$pdsim" testbed --quiet --mode both --max-requests 4 --transport-fault 'drop:p=2'
case_ "simulate --time-scale 1e308" 2 "--time-scale" -- "${sim[@]}" --trace "$code_trace" --time-scale 1e308
case_ "search --cv 1e308" 2 "--cv" -- "$pdsim" search --cv 1e308
case_ "--request-timeout-s 1e10" 2 "--request-timeout-s" -- "${tb[@]}" --request-timeout-s 1e10
case_ "--threads 100000" 2 "--threads" -- "${tb[@]}" --threads 100000
for f in --max-batch-tokens --max-decode-batch --synthetic; do
  case_ "testbed $f 2147483647" 2 "$f" -- "${tb[@]}" "$f" 2147483647
done
for v in 0 -1; do
  case_ "testbed --layers $v" 2 "--layers" -- "${tb[@]}" --layers "$v"
  case_ "simulate --max-requests $v" 2 "--max-requests" -- "$pdsim" simulate --max-requests "$v"
  case_ "simulate --sample $v" 2 "--sample" -- "${sim[@]}" --trace "$code_trace" --sample "$v"
  case_ "testbed --synthetic $v" 2 "--synthetic" -- "${tb[@]}" --synthetic "$v"
  case_ "calibrate --repeats $v" 2 "--repeats" -- "$pdsim" calibrate --repeats "$v" --out x.json
  case_ "calibrate --node-cpus $v" 2 "--node-cpus" -- "$pdsim" calibrate --node-cpus "$v" --out x.json
  case_ "bench transfer --window $v" 2 "--window" -- "$pdsim" bench transfer --window "$v"
  case_ "simulate --time-scale $v" 2 "--time-scale" -- "${sim[@]}" --trace "$code_trace" --time-scale "$v"
done
for f in --report --timeline --requests; do
  case_ "testbed $f /proc/x/r.json" 2 "$f" -- "${tb[@]}" "$f" /proc/x/r.json
done
case_ "search --json /proc/x/r.json" 2 "--json" -- "$pdsim" search --json /proc/x/r.json
case_ "bench transfer --json /proc/x/r.json" 2 "--json" -- \
  "$pdsim" bench transfer --json /proc/x/r.json

# A trace whose file name holds a byte that is not UTF-8: a legal name; the run goes on and the
# report is valid JSON (the name is sanitized in it).
cp "$root/data/traces/azure_llm_code.csv" "$tmp/name_$(printf '\xff').csv"
case_ "trace name with byte 0xFF, --report" 0 "" -- \
  "${tb[@]}" --trace "$tmp/name_$(printf '\xff').csv" --report "$tmp/r.json"
if python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$tmp/r.json" 2>/dev/null; then
  echo "ok   | report of that run parses as JSON"
else
  echo "FAIL | report of that run does not parse as JSON"; bad=1
fi

# Rank count under mpirun: pdsim's own message on every run (it was printed in 4 of 8).
if command -v mpirun >/dev/null 2>&1; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  for i in 1 2 3 4 5 6 7 8; do
    case_ "mpirun -np 3 on a 2-rank topology, run $i" 2 "ranks" -- \
      mpirun --oversubscribe -np 3 "$pdsim" testbed --quiet --max-requests 2
  done
  case_ "PDSIM_SESSION_TOKEN too short (tcp)" 2 "PDSIM_SESSION_TOKEN" -- \
    mpirun --oversubscribe -np 2 -x PDSIM_SESSION_TOKEN=short "$pdsim" testbed --quiet \
    --max-requests 2 --transport tcp
fi

[ "$bad" = 0 ] && echo "input_walk.sh: every case ok" || echo "input_walk.sh: some cases FAILED"
exit "$bad"
