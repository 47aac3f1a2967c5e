#!/usr/bin/env bash
# Serving throughput with the step CUDA graphs on against `--cuda-graph-max-tokens 0`
# (steps with prefill tokens eager), in A-B-B-A order on one GPU from this tree. Each server run takes a
# short warm-up burst, then the measured saturating bursts: base-only, then 32 resident rank-16 adapters
# (1,000 requests of 256 in / 128 out, all at once), and writes results.md, one JSON per burst and the
# server logs into OUT_DIR. About 6 minutes on an H100 with the 1B-shaped model.
#   usage: bash benchmarks/run_graphs_bench.sh OUT_DIR
# Knobs: NUM_PROMPTS (1000), WARMUP_PROMPTS (256), NUM_ADAPTERS (32), ORDER ("on off off on"), SERVER_FLAGS, ON_FLAGS (the graphs'
# side: "" = the default --cuda-graph-max-tokens), OFF_FLAGS (the other side: default --cuda-graph-max-tokens 0;
# any A/B of one flag works, with TITLE for the results' heading), PRESET (1b), DEVICE (cuda), DTYPE, PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${TMPDIR:-/tmp}/lorapipe-bench/graphs_bench}")
py=${PYTHON:-python}
num=${NUM_PROMPTS:-1000} nad=${NUM_ADAPTERS:-32} order=${ORDER:-"on off off on"}
device=${DEVICE:-cuda} preset=${PRESET:-1b} dtype=${DTYPE:-bfloat16}
server_flags=${SERVER_FLAGS:-"--max-loras-per-batch 32 --max-cpu-loras 32 --max-lora-rank 16 --max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192"}
on_flags=${ON_FLAGS:-} off_flags=${OFF_FLAGS:-"--cuda-graph-max-tokens 0"}
title=${TITLE:-"Step CUDA graphs on vs --cuda-graph-max-tokens 0"}
port=${PORT:-29100}
scratch=${SCRATCH:-$out/scratch}
mkdir -p "$out" "$scratch"
model=$scratch/llama-$preset adir=$scratch/adapters
[ -f "$model/config.json" ] || "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype "$dtype" --seed 0
[ -f "$adir/adapter$((nad - 1))/adapter_config.json" ] ||
  "$py" -m tools.make_adapters "$model" "$adir" --n "$nad" --ranks 16 --targets all --dtype "$dtype" --seed 0
gen=(--input-len 256 --output-len 128 --num-adapters "$nad" --request-rate inf)
"$py" -m tools.workload --out "$out/workload_adapters.jsonl" --num-prompts "$num" "${gen[@]}" --seed 0
"$py" -m tools.workload --out "$out/workload_base.jsonl" --num-prompts "$num" "${gen[@]}" --seed 0 --base-share 1.0
"$py" -m tools.workload --out "$out/workload_warmup.jsonl" --num-prompts "${WARMUP_PROMPTS:-256}" "${gen[@]}" --seed 999 --base-share 0.5

server=
stop_server() { if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; wait "$server" || true; fi; server=; }
trap stop_server EXIT

run_one() { # $1: on or off, $2: run index
  local side=$1 label=$1$2 i flags
  local adapter_args=() endpoint=tcp://127.0.0.1:$port metrics=http://127.0.0.1:$((port + 1))/metrics
  for ((i = 0; i < nad; i++)); do adapter_args+=(--adapter "adapter$i=$adir/adapter$i"); done
  [ "$side" = on ] && flags=$on_flags || flags=$off_flags
  local t0=$SECONDS
  # shellcheck disable=SC2086  # the flag variables are lists of flags
  "$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" $server_flags $flags \
    --endpoint "$endpoint" --metrics-port $((port + 1)) "${adapter_args[@]}" >"$out/server_$label.log" 2>&1 &
  server=$!
  for ((i = 0; ; i++)); do
    kill -0 "$server" 2>/dev/null || { echo "server $label exited; see $out/server_$label.log" >&2; exit 1; }
    "$py" -c "import sys; from runtime.client import Client
with Client(sys.argv[1], timeout=2.0) as c: sys.exit(0 if c.health().ok else 1)" "$endpoint" 2>/dev/null && break
    [ "$i" -lt 600 ] || { echo "server $label not ready after 600 s" >&2; exit 1; }
    sleep 1
  done
  echo "$label ready after $((SECONDS - t0)) s" | tee -a "$out/ready.txt"
  local bench=("$py" -m tools.bench_serving --endpoint "$endpoint" --metrics-url "$metrics" --metrics-interval 0)
  "${bench[@]}" --workload "$out/workload_warmup.jsonl" --quiet --label "warm-up $label"
  for w in base adapters; do
    "${bench[@]}" --workload "$out/workload_$w.jsonl" --label "$label $w" --out "$out/run_${label}_$w.json" | tail -4
  done
  "$py" -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "$metrics" >"$out/metrics_$label.txt"
  stop_server
}

n=0
for side in $order; do n=$((n + 1)); run_one "$side" "$n"; done
"$py" - "$out" "$num requests, 256 in / 128 out, all at once; preset $preset, $dtype; runs in order: $order; on: \"$on_flags\", off: \"$off_flags\"" "$title" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {}  # (workload, side) -> [(run, tok/s, ttft p50, e2e p50)]
for f in sorted(out.glob("run_*.json")):
    s = json.loads(f.read_text())["summary"]
    run, workload = f.stem[4:].rsplit("_", 1)
    side = run.rstrip("0123456789")
    runs.setdefault((workload, side), []).append((run, s["output_throughput"], s["ttft"]["p50"], s["e2e"]["p50"]))
lines = ["# " + sys.argv[3], "",
         sys.argv[2] + ".", "",
         "| workload | side | runs: output tok/s | median tok/s | median TTFT P50 (s) | median E2E P50 (s) |",
         "| --- | --- | --- | --- | --- | --- |"]
med = {}
for (workload, side), rows in sorted(runs.items()):
    med[workload, side] = statistics.median(r[1] for r in rows)
    lines.append(f"| {workload} | {side} | {', '.join(f'{r[0]}: {r[1]:.0f}' for r in rows)} | "
                 f"{med[workload, side]:.0f} | {statistics.median(r[2] for r in rows):.3f} | "
                 f"{statistics.median(r[3] for r in rows):.3f} |")
lines.append("")
for workload in ("base", "adapters"):
    if (workload, "on") in med and (workload, "off") in med:
        lines.append(f"- {workload}: on/off = {med[workload, 'on'] / med[workload, 'off']:.3f}")
if ("base", "on") in med and ("adapters", "on") in med:
    lines.append(f"- on: adapters/base = {med['adapters', 'on'] / med['base', 'on']:.3f}")
lines += ["", "Server start-up and graph counters (last run of each side):", ""]
for side in ("on", "off"):
    logs = sorted(out.glob(f"server_{side}*.log"))
    if not logs:
        continue
    text = logs[-1].read_text(errors="replace")
    found = [m.group(0).strip() for m in re.finditer(r"(captured .*|CUDA graph memory pool.*|warm-up done.*)", text)]
    lines.append(f"- {side}: " + "; ".join(found))
    metrics = out / f"metrics_{logs[-1].stem.removeprefix('server_')}.txt"
    if metrics.exists():
        for m in re.finditer(r"^(lorapipe_(?:decode|step)_graph_replays)\S* (\S+)", metrics.read_text(), re.M):
            lines.append(f"  - {m.group(1)} = {float(m.group(2)):.0f}")
text = "\n".join(lines) + "\n"
(out / "results.md").write_text(text)
print(text)
EOF
