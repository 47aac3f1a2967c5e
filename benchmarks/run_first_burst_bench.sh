#!/usr/bin/env bash
# Time to ready and the first burst after it, on the GPU in one command (Llama-3.2-1B-shaped model, 32
# rank-16 adapters):
#   1. start `lorapipe serve` with an empty compile cache and time it to ready (cold start: warm-up
#      compiles every kernel variant);
#   2. a 1,000-request burst (256 in / 128 out, all at once, uniform over the adapters), then the identical
#      burst again: the first must reach >= MIN_RATIO x the second's output throughput;
#   3. restart with the now warm compile cache and time it to ready (target <= MAX_WARM_READY_S), then
#      the burst once more;
#   CONTROL=1 adds the same start and two bursts with --no-warmup (an empty cache of its own): what a
#   first burst costs without the warm-up.
# Writes OUT_DIR/results.md (the summary table, also printed) and results.json, the bench JSONs and logs.
#   usage: bash benchmarks/run_first_burst_bench.sh [OUT_DIR]     (default: $OUT, else $TMPDIR/lorapipe-bench/...; knobs: the variables below)
#   CPU smoke test: DEVICE=cpu PRESET=tiny DTYPE=float32 NUM_PROMPTS=8 INPUT_LEN=16 OUTPUT_LEN=8 \
#     NUM_ADAPTERS=4 SERVER_FLAGS="--max-loras-per-batch 4 --max-cpu-loras 4 --max-lora-rank 16 --num-pages 256" \
#     bash benchmarks/run_first_burst_bench.sh /tmp/fb
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${OUT:-${TMPDIR:-/tmp}/lorapipe-bench/first_burst_bench}}")
py=${PYTHON:-python3}
scratch=${SCRATCH:-$out/scratch}   # model and adapters, reused when complete (1b: about 2.5 GB + 32 x 22 MB)
device=${DEVICE:-cuda} preset=${PRESET:-1b} dtype=${DTYPE:-bfloat16}
nad=${NUM_ADAPTERS:-32}
num=${NUM_PROMPTS:-1000}
in_len=${INPUT_LEN:-256} out_len=${OUTPUT_LEN:-128}
seed=${SEED:-0}
port=${PORT:-28200}
server_flags=${SERVER_FLAGS:-"--max-loras-per-batch 32 --max-cpu-loras 32 --max-lora-rank 16 --max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192"}
min_ratio=${MIN_RATIO:-0.9}
max_warm_ready=${MAX_WARM_READY_S:-30}
control=${CONTROL:-0}
ready_timeout=${READY_TIMEOUT_S:-600}
mkdir -p "$out" "$scratch"
timings=()
part_start=$SECONDS
done_part() { timings+=("$1: $((SECONDS - part_start)) s"); echo "== $1 took $((SECONDS - part_start)) s"; part_start=$SECONDS; }

# --- model, adapters, workload (a .complete marker makes a rerun reuse them) -------------------------------
model=$scratch/llama-$preset-$dtype adir=$scratch/adapters-$preset-r16-n$nad-$dtype
if [ ! -f "$model/.complete" ]; then
  rm -rf "$model"
  "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype "$dtype" --seed 0
  touch "$model/.complete"
fi
if [ ! -f "$adir/.complete" ]; then
  rm -rf "$adir"
  "$py" -m tools.make_adapters "$model" "$adir" --n "$nad" --ranks 16 --targets all --dtype "$dtype" --seed 0 >/dev/null
  touch "$adir/.complete"
fi
"$py" -m tools.workload --out "$out/burst.jsonl" --num-prompts "$num" --input-len "$in_len" --output-len "$out_len" \
  --num-adapters "$nad" --adapter-distribution uniform --request-rate inf --seed "$seed"
adapters=()
for ((i = 0; i < nad; i++)); do adapters+=(--adapter "adapter$i=$adir/adapter$i"); done
done_part "model, adapters, workload"

# --- one server at a time ------------------------------------------------------------------------------------
server= endpoint= metrics= nserver=0 ready_s=
start_server() { # LOG CACHE_DIR FLAGS... -> sets server, endpoint, metrics, ready_s (seconds from launch to ready)
  local log=$1 cache=$2 p=$((port + 2 * nserver)) t0
  shift 2
  nserver=$((nserver + 1)) endpoint=tcp://127.0.0.1:$p metrics=http://127.0.0.1:$((p + 1))/metrics
  t0=$(date +%s.%N)
  # shellcheck disable=SC2086  # server_flags is a list of flags
  "$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" $server_flags "${adapters[@]}" \
    --compile-cache-dir "$cache" --startup-timeout "$ready_timeout" --endpoint "$endpoint" \
    --metrics-port $((p + 1)) "$@" >"$log" 2>&1 &
  server=$!
  ready_s=$("$py" -m tools.wait_ready "$endpoint" --since "$t0" --pid "$server" --timeout "$ready_timeout") ||
    { echo "lorapipe serve did not become ready; see $log" >&2; tail -n 20 "$log" >&2; exit 1; }
  echo "ready in $ready_s s ($log)"
}
stop_server() { if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; wait "$server" || true; fi; server=; }
trap stop_server EXIT
burst() { # LABEL NAME: the workload once -> OUT/NAME.json
  "$py" -m tools.bench_serving --endpoint "$endpoint" --metrics-url "$metrics" --workload "$out/burst.jsonl" \
    --label "$1" --out "$out/$2.json" --quiet
}

# --- cold compile cache: start, two bursts ---------------------------------------------------------------------
rm -rf "$out/compile_cache"
start_server "$out/server_cold.log" "$out/compile_cache"
cold_ready=$ready_s
burst "first burst after a cold start" first
burst "second burst" second
stop_server
done_part "cold start + 2 bursts"

# --- warm compile cache: restart, one burst -------------------------------------------------------------------
start_server "$out/server_warm.log" "$out/compile_cache"
warm_ready=$ready_s
burst "first burst after a warm restart" warm_first
stop_server
done_part "warm restart + 1 burst"

runs=(--run "first burst=$out/first.json" --run "second burst=$out/second.json"
  --run "first burst after a warm restart=$out/warm_first.json")
if [ "$control" = 1 ]; then
  rm -rf "$out/compile_cache_control"
  start_server "$out/server_control.log" "$out/compile_cache_control" --no-warmup
  echo "control (--no-warmup) ready in $ready_s s"
  burst "no warm-up: first burst" control_first
  burst "no warm-up: second burst" control_second
  stop_server
  runs+=(--run "no warm-up: first burst=$out/control_first.json" --run "no warm-up: second burst=$out/control_second.json")
  done_part "control: --no-warmup start + 2 bursts"
fi

# --- summary -----------------------------------------------------------------------------------------------------
{
  echo "# First burst after ready: $(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' || true
  "$py" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')" 2>/dev/null || true
  echo "PRESET=$preset DTYPE=$dtype NUM_ADAPTERS=$nad (rank 16) NUM_PROMPTS=$num ($in_len in / $out_len out, all at once);" \
    "SERVER_FLAGS=\"$server_flags\". Part times: ${timings[*]/%/;}"
  echo
  "$py" -m benchmarks.first_burst_report --cold-ready "$cold_ready" --warm-ready "$warm_ready" \
    --cold-log "$out/server_cold.log" --warm-log "$out/server_warm.log" "${runs[@]}" \
    --min-ratio "$min_ratio" --max-warm-ready "$max_warm_ready" --out "$out/results.json"
} >"$out/results.md"
cat "$out/results.md"
