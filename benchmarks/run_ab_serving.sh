#!/usr/bin/env bash
# Side-by-side serving throughput of two source trees on one GPU, A-B-B-A: each run starts `lorapipe serve`
# from its tree, sends a warm-up burst, then the measured saturating burst, and stops the server.
#   usage: bash benchmarks/run_ab_serving.sh OUT_DIR TREE_A TREE_B
# TREE_A/TREE_B are checkouts (e.g. `git archive COMMIT | tar -x -C .base`). Each tree's own client and
# benchmark drive its own server. Knobs: NUM_PROMPTS (1000), INPUT_LEN (256), OUTPUT_LEN (128),
# NUM_ADAPTERS (32), ORDER ("A B B A"),
# SERVER_FLAGS, A_FLAGS / B_FLAGS (flags for one side only, e.g. B_FLAGS="--cuda-graph-max-tokens 0" to switch
# off in the newer tree what the older one lacks), BASE_ONLY=1 (requests without adapters), PRESET (1b),
# DEVICE (cuda), DTYPE (bfloat16).
set -euo pipefail
out=$(realpath -m "${1:-${TMPDIR:-/tmp}/lorapipe-bench/ab_serving}")
tree_a=$(realpath "${2:?TREE_A}") tree_b=$(realpath "${3:?TREE_B}")
py=${PYTHON:-python}
num=${NUM_PROMPTS:-1000} nad=${NUM_ADAPTERS:-32} order=${ORDER:-"A B B A"}
device=${DEVICE:-cuda} preset=${PRESET:-1b} dtype=${DTYPE:-bfloat16}
server_flags=${SERVER_FLAGS:-"--max-loras-per-batch 32 --max-cpu-loras 32 --max-lora-rank 16 --max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192"}
port=${PORT:-29000}
scratch=${SCRATCH:-$out/scratch}
mkdir -p "$out" "$scratch"
model=$scratch/llama-$preset adir=$scratch/adapters
cd "$tree_a"
[ -f "$model/config.json" ] || PYTHONPATH=$tree_a${PYTHONPATH:+:$PYTHONPATH} "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype "$dtype" --seed 0
[ -f "$adir/adapter$((nad - 1))/adapter_config.json" ] ||
  PYTHONPATH=$tree_a${PYTHONPATH:+:$PYTHONPATH} "$py" -m tools.make_adapters "$model" "$adir" --n "$nad" --ranks 16 --targets all --dtype "$dtype" --seed 0
gen=(--num-prompts "$num" --input-len "${INPUT_LEN:-256}" --output-len "${OUTPUT_LEN:-128}" --num-adapters "$nad"
  --request-rate inf --seed 0)
[ -z "${BASE_ONLY:-}" ] || gen+=(--base-share 1.0)
PYTHONPATH=$tree_a${PYTHONPATH:+:$PYTHONPATH} "$py" -m tools.workload --out "$out/workload.jsonl" "${gen[@]}"

server=
stop_server() { if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; wait "$server" || true; fi; server=; }
trap stop_server EXIT

run_one() {  # $1: A or B, $2: run index
  local tree i label=$1$2
  local side_flags
  [ "$1" = A ] && tree=$tree_a side_flags=${A_FLAGS:-} || tree=$tree_b side_flags=${B_FLAGS:-}
  local adapter_args=() endpoint=tcp://127.0.0.1:$port metrics=http://127.0.0.1:$((port + 1))/metrics
  for ((i = 0; i < nad; i++)); do adapter_args+=(--adapter "adapter$i=$adir/adapter$i"); done
  cd "$tree"
  local t0=$SECONDS
  # shellcheck disable=SC2086
  PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} "$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" $server_flags $side_flags \
    --endpoint "$endpoint" --metrics-port $((port + 1)) "${adapter_args[@]}" >"$out/server_$label.log" 2>&1 &
  server=$!
  for ((i = 0; ; i++)); do
    kill -0 "$server" 2>/dev/null || { echo "server $label exited; see $out/server_$label.log" >&2; exit 1; }
    PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} "$py" -c "import sys; from runtime.client import Client
with Client(sys.argv[1], timeout=2.0) as c: sys.exit(0 if c.health().ok else 1)" "$endpoint" 2>/dev/null && break
    [ "$i" -lt 600 ] || { echo "server $label not ready after 600 s" >&2; exit 1; }
    sleep 1
  done
  echo "$label ready after $((SECONDS - t0)) s" | tee -a "$out/ready.txt"
  local bench=("$py" -m tools.bench_serving --endpoint "$endpoint" --metrics-url "$metrics" --metrics-interval 0)
  PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} "${bench[@]}" --workload "$out/workload.jsonl" --quiet --label "warm-up $label"
  PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} "${bench[@]}" --workload "$out/workload.jsonl" --label "$label" --out "$out/run_$label.json" | tail -25
  stop_server
}

n=0
for side in $order; do n=$((n + 1)); run_one "$side" "$n"; done
cd "$tree_a"
PYTHONPATH=$tree_a${PYTHONPATH:+:$PYTHONPATH} "$py" - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("run_*.json")):
    d = json.loads(f.read_text())
    s = d["summary"]
    rows.setdefault(f.stem[4], []).append((f.stem[4:], s["output_throughput"], s["ttft"]["p50"]))
print("| run | output tok/s | TTFT P50 |\n| --- | --- | --- |")
for side, runs in sorted(rows.items()):
    for label, tput, ttft in runs:
        print(f"| {label} | {tput} | {ttft} |")
med = {k: statistics.median(t for _, t, _ in v) for k, v in rows.items() if all(t for _, t, _ in v)}
if len(med) == 2:
    print(f"\nmedian A {med['A']:.0f} tok/s, B {med['B']:.0f} tok/s, A/B = {med['A'] / med['B']:.3f}")
(out / "ab_summary.json").write_text(json.dumps({"runs": rows, "median": med}, indent=1))
EOF
