#!/usr/bin/env bash
# HTTP front end vs the ZeroMQ SDK on one server, same workload files: Llama-3.2-1B-shaped model + 32 rank-16
# adapters. Saturating (every request at once) in A-B-B-A order (sdk, http, http, sdk), then low load (1 req/s)
# the same way for median TTFT. Prints one table and the two targets (HTTP tok/s >= 0.95x SDK; median TTFT
# overhead <= 2 ms); full results under OUT_DIR.
#   usage: bash benchmarks/run_http_bench.sh [OUT_DIR]    (knobs: the environment variables below; CLIENT_PROCS:
#   HTTP client processes, default 4)
#   CPU smoke test: DEVICE=cpu PRESET=tiny DTYPE=float32 NUM_PROMPTS=16 LOW_PROMPTS=4 NUM_ADAPTERS=4 \
#     OUTPUT_LEN=8 INPUT_LEN=16 SERVER_FLAGS="--max-loras-per-batch 4 --max-lora-rank 16 --num-pages 512" ...
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${TMPDIR:-/tmp}/lorapipe-bench/http_bench}")
py=${PYTHON:-python}
scratch=${SCRATCH:-$out/scratch}
num=${NUM_PROMPTS:-500}
low=${LOW_PROMPTS:-64}             # low-load run: this many requests at LOW_RATE req/s
low_rate=${LOW_RATE:-1}
warm=${WARMUP:-64}                 # warm-up requests through each door
nad=${NUM_ADAPTERS:-32}
in_len=${INPUT_LEN:-256} out_len=${OUTPUT_LEN:-128}
port=${PORT:-28100}
seed=${SEED:-0}
server_flags=${SERVER_FLAGS:-"--max-loras-per-batch 32 --max-cpu-loras 32 --max-lora-rank 16 --max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192"}
device=${DEVICE:-cuda} preset=${PRESET:-1b} dtype=${DTYPE:-bfloat16}
endpoint=tcp://127.0.0.1:$port
metrics=http://127.0.0.1:$((port + 1))/metrics
base_url=http://127.0.0.1:$((port + 2))/v1
mkdir -p "$out" "$scratch"

model=$scratch/llama-$preset adir=$scratch/adapters
[ -f "$model/config.json" ] || "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype "$dtype" --seed 0
[ -f "$adir/adapter$((nad - 1))/adapter_config.json" ] ||
  "$py" -m tools.make_adapters "$model" "$adir" --n "$nad" --ranks 16 --targets all --dtype "$dtype" --seed 0
gen=(--input-len "$in_len" --output-len "$out_len" --num-adapters "$nad" --seed "$seed" --adapter-distribution uniform)
"$py" -m tools.workload --out "$out/workload_sat.jsonl" --num-prompts "$num" --request-rate inf "${gen[@]}"
"$py" -m tools.workload --out "$out/workload_low.jsonl" --num-prompts "$low" --request-rate "$low_rate" "${gen[@]}"

server=
stop_server() { if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; wait "$server" || true; fi; }
trap stop_server EXIT
adapter_args=()
for ((i = 0; i < nad; i++)); do adapter_args+=(--adapter "adapter$i=$adir/adapter$i"); done
# shellcheck disable=SC2086  # server_flags is a list of flags
"$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" $server_flags "${adapter_args[@]}" \
  --endpoint "$endpoint" --metrics-port $((port + 1)) --port $((port + 2)) >"$out/server.log" 2>&1 &
server=$!
for ((i = 0; ; i++)); do
  kill -0 "$server" 2>/dev/null || { echo "lorapipe serve exited; see $out/server.log" >&2; exit 1; }
  "$py" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "${base_url%/v1}/health" 2>/dev/null && break
  [ "$i" -lt 900 ] || { echo "lorapipe serve not ready after 900 s" >&2; exit 1; }
  sleep 1
done

bench=("$py" -m tools.bench_serving --metrics-url "$metrics" --quiet)
sdk=(--backend lorapipe --endpoint "$endpoint")
# several client processes on the HTTP side: one Python process parsing SSE caps what it can measure
http=(--backend openai --base-url "$base_url" --client-procs "${CLIENT_PROCS:-4}")
# warm-up through both doors (first-use kernel compiles are not what is measured)
"${bench[@]}" "${sdk[@]}" --num-prompts "$warm" "${gen[@]}" --request-rate inf --seed 999
"${bench[@]}" "${http[@]}" --num-prompts "$warm" "${gen[@]}" --request-rate inf --seed 998
for load in sat low; do
  order=(sdk http http sdk)
  for k in 0 1 2 3; do
    door=${order[$k]} n=$((k < 2 ? 1 : 2))
    [ "$door" = sdk ] && args=("${sdk[@]}") || args=("${http[@]}")
    "${bench[@]}" "${args[@]}" --workload "$out/workload_$load.jsonl" --label "$door $load #$n" \
      --out "$out/${door}_${load}_$n.json"
  done
done
"$py" -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
  "${base_url%/v1}/metrics" >"$out/server_metrics.txt" # /metrics as the HTTP port serves it
stop_server

{
  echo "# HTTP front end vs ZeroMQ SDK: $(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
  echo
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' || true
  echo "$nad adapters, uniform, $in_len in / $out_len out; saturating: $num requests at once; low load: $low at $low_rate req/s"
  echo "server flags: $server_flags"
  echo
  "$py" -m tools.bench_report "$out"/{sdk,http}_sat_{1,2}.json "$out"/{sdk,http}_low_{1,2}.json --baseline "$out/sdk_sat_1.json"
  echo
  "$py" - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def s(name): return json.loads((out / f"{name}.json").read_text())["summary"]
tput = {d: statistics.mean(s(f"{d}_sat_{i}")["output_throughput"] for i in (1, 2)) for d in ("sdk", "http")}
ttft = {d: statistics.mean(s(f"{d}_low_{i}")["ttft"]["p50"] for i in (1, 2)) for d in ("sdk", "http")}
ratio, overhead = tput["http"] / tput["sdk"], (ttft["http"] - ttft["sdk"]) * 1e3
print(f"HTTP/SDK saturated output tok/s: {ratio:.3f} (target >= 0.95) {'PASS' if ratio >= 0.95 else 'MISS'}")
print(f"median TTFT overhead at low load: {overhead:+.2f} ms (target <= 2 ms) {'PASS' if overhead <= 2 else 'MISS'}")
EOF
} >"$out/results.md"
cat "$out/results.md"
