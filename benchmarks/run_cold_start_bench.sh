#!/usr/bin/env bash
# Cold start on the GPU in one command (Llama-3.2-1B-shaped model; docs/deploy.md "Compile cache"):
#   a. 96 adapters of ranks 8/16/32/64 (max rank 64), EMPTY compile cache: time to ready, then a 1,000-request
#      burst (256 in / 128 out, all at once, uniform over the adapters) and another of the same shape: the
#      first must reach >= MIN_RATIO x the second's output throughput;
#   b. 32 rank-16 adapters, EMPTY compile cache: time to ready;
#   c. `lorapipe warmup` with a's arguments into another empty cache, then a server of a's configuration
#      started on it: time to ready, minus the time to read the weights (timed apart, page cache warm);
#      then benchmarks/startup_probe.py (the launcher's path to spawning, CUDA init, imports);
#   s1 (S1=1, the default): the 2,000-adapter S1 server of run_churn_bench.sh (rank 16, GPU pool 4 GB, host
#      cache 16 GB) on an empty cache: time to ready, then the 1,000-request burst over 8 adapters twice.
# Distinct adapter files: 4 per rank (16 for S1); the N names are directory symlinks onto them (as in
# run_churn_bench.sh), so every adapter is loaded, validated and packed as its own, from the page cache.
# Writes OUT_DIR/results.md (the summary table, also printed) and results.json, the bench JSONs and logs.
#   usage: bash benchmarks/run_cold_start_bench.sh OUT_DIR     knobs: the variables below (PARTS="a b c s1",
#   the parts to run; S1=0 drops s1)
#   CPU smoke test (no c): DEVICE=cpu PRESET=tiny DTYPE=float32 NUM_PROMPTS=8 S1=0 \
#     SERVER_FLAGS="--max-model-len 512 --num-pages 512" bash benchmarks/run_cold_start_bench.sh /tmp/cs
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${OUT:-${TMPDIR:-/tmp}/lorapipe-bench/cold_start_bench}}")
py=${PYTHON:-python3}
scratch=${SCRATCH:-$out/scratch}
device=${DEVICE:-cuda} preset=${PRESET:-1b} dtype=${DTYPE:-bfloat16}
num=${NUM_PROMPTS:-1000} parts=" ${PARTS:-a b c s1} "
[ "${S1:-1}" = 1 ] || parts=${parts/ s1 / }
want() { [[ $parts == *" $1 "* ]]; }
s1=0
want s1 && s1=1
port=${PORT:-28400}
common=${SERVER_FLAGS:-"--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192"}
mixed_flags="--max-lora-rank 64"
r16_flags="--max-lora-rank 16"
s1_flags="--max-lora-rank 16 --lora-gpu-memory-gb 4 --cpu-lora-cache-gb 16"
min_ratio=${MIN_RATIO:-0.95}
ready_timeout=${READY_TIMEOUT_S:-600}
mkdir -p "$out" "$scratch"
part_start=$SECONDS timings=()
done_part() { timings+=("$1: $((SECONDS - part_start)) s"); echo "== $1 took $((SECONDS - part_start)) s"; part_start=$SECONDS; }

# --- model, adapters, workloads (reused when complete) -----------------------------------------------------
model=$scratch/llama-$preset-$dtype
if [ ! -f "$model/.complete" ]; then
  rm -rf "$model"
  "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype "$dtype" --seed 0
  touch "$model/.complete"
fi
real_adapters() {  # DIR N RANKS
  if [ ! -f "$1/.complete" ]; then
    rm -rf "$1"
    "$py" -m tools.make_adapters "$model" "$1" --n "$2" --ranks "$3" --targets all --dtype "$dtype" --seed 0 >/dev/null
    touch "$1/.complete"
  fi
}
link_adapters() {  # DIR N REAL_DIR REAL_N
  mkdir -p "$1"
  local i
  for ((i = 0; i < $2; i++)); do [ -e "$1/adapter$i" ] || ln -s "$3/adapter$((i % $4))" "$1/adapter$i"; done
}
real_adapters "$scratch/realmix" 16 8,16,32,64
real_adapters "$scratch/real16" 16 16
link_adapters "$scratch/mixed" 96 "$scratch/realmix" 16
link_adapters "$scratch/r16" 32 "$scratch/real16" 16
g=(--num-prompts "$num" --input-len 256 --output-len 128 --request-rate inf --adapter-distribution uniform)
# The second burst has the first's shape but other prompts (seed 1): the same prompts again would be
# served from the prefix cache, which says nothing about what still runs after ready.
for s in 0 1; do
  "$py" -m tools.workload --out "$out/burst96_$s.jsonl" "${g[@]}" --num-adapters 96 --seed $s
  if [ "$s1" = 1 ]; then
    "$py" -m tools.workload --out "$out/burst8_$s.jsonl" "${g[@]}" --num-adapters 8 --seed $s
  fi
done
[ "$s1" = 1 ] && link_adapters "$scratch/s1" 2000 "$scratch/real16" 16
done_part "model, adapters, workloads"

# --- one server at a time ------------------------------------------------------------------------------------
server= endpoint= metrics= nserver=0 ready_s=
start_server() {  # LABEL ADAPTER_DIR COUNT CACHE_DIR FLAGS... -> server, endpoint, metrics, ready_s
  local label=$1 adir=$2 n=$3 cache=$4 p=$((port + 2 * nserver)) t0 i args=()
  shift 4
  for ((i = 0; i < n; i++)); do args+=(--adapter "adapter$i=$adir/adapter$i"); done
  nserver=$((nserver + 1)) endpoint=tcp://127.0.0.1:$p metrics=http://127.0.0.1:$((p + 1))/metrics
  t0=$(date +%s.%N)
  # shellcheck disable=SC2086  # flag lists
  "$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" $common "$@" "${args[@]}" \
    --compile-cache-dir "$cache" --startup-timeout "$ready_timeout" --endpoint "$endpoint" \
    --metrics-port $((p + 1)) >"$out/server_$label.log" 2>&1 &
  server=$!
  ready_s=$("$py" -m tools.wait_ready "$endpoint" --since "$t0" --pid "$server" --timeout "$ready_timeout") ||
    { echo "server $label did not become ready; see $out/server_$label.log" >&2; tail -n 20 "$out/server_$label.log" >&2; exit 1; }
  echo "$label: ready in $ready_s s"
  echo "$label=$ready_s" >>"$out/ready.txt"
}
stop_server() { if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; wait "$server" || true; fi; server=; }
trap stop_server EXIT
burst() {  # WORKLOAD NAME
  "$py" -m tools.bench_serving --endpoint "$endpoint" --metrics-url "$metrics" --workload "$1" \
    --label "$2" --out "$out/$2.json" --quiet
}
rm -f "$out/ready.txt" "$out/startup_probe.md"

# a. 96 mixed-rank adapters, empty cache, two bursts
if want a; then
  rm -rf "$out/cache_a"
  # shellcheck disable=SC2086
  start_server mixed_cold "$scratch/mixed" 96 "$out/cache_a" $mixed_flags
  burst "$out/burst96_0.jsonl" mixed_first
  burst "$out/burst96_1.jsonl" mixed_second
  stop_server
  done_part "a: 96 mixed-rank adapters, empty cache, 2 bursts"
fi

# b. 32 rank-16 adapters, empty cache
if want b; then
  rm -rf "$out/cache_b"
  # shellcheck disable=SC2086
  start_server r16_cold "$scratch/r16" 32 "$out/cache_b" $r16_flags
  stop_server
  done_part "b: 32 rank-16 adapters, empty cache"
fi

# c. a cache made by `lorapipe warmup`, then a's server on it; the weights' read time apart (CUDA only)
if [ "$device" = cuda ] && want c; then
rm -rf "$out/cache_c"
t0=$SECONDS
# shellcheck disable=SC2086
"$py" -m runtime.cli warmup --model "$model" --device "$device" --dtype "$dtype" $common $mixed_flags \
  --compile-cache-dir "$out/cache_c" >"$out/warmup_cli.json" 2>"$out/warmup_cli.log"
echo "warmup_cli_s=$((SECONDS - t0))" >>"$out/ready.txt"
# shellcheck disable=SC2086
start_server mixed_prebuilt "$scratch/mixed" 96 "$out/cache_c" $mixed_flags
stop_server
"$py" - "$model" "$dtype" >>"$out/ready.txt" <<'PY'
import sys, time, torch
from runtime.common.model_config import ModelConfig, parse_dtype
from stages.worker.model.weights import load_weights
cfg = ModelConfig.from_dir(sys.argv[1])
load_weights(sys.argv[1], cfg, parse_dtype(sys.argv[2], cfg.dtype), torch.device("cuda"))  # page cache warm
torch.cuda.synchronize(); t = time.perf_counter()
load_weights(sys.argv[1], cfg, parse_dtype(sys.argv[2], cfg.dtype), torch.device("cuda"))
torch.cuda.synchronize(); print(f"weights_read_s={time.perf_counter() - t:.2f}")
PY
# where the seconds before the worker's model runner go on this machine (launcher path, driver, imports)
"$py" -m benchmarks.startup_probe "$out" --model "$model" --adapters "$scratch/mixed" --num-adapters 96 \
  --max-lora-rank 64 --device "$device" >"$out/startup_probe.md"
done_part "c: lorapipe warmup, then a's server on its cache"
fi

# s1. the 2,000-adapter S1 server, empty cache, two bursts over 8 adapters
if [ "$s1" = 1 ]; then
  rm -rf "$out/cache_s1"
  # shellcheck disable=SC2086
  start_server s1_cold "$scratch/s1" 2000 "$out/cache_s1" $s1_flags
  burst "$out/burst8_0.jsonl" s1_first
  burst "$out/burst8_1.jsonl" s1_second
  stop_server
  done_part "s1: 2,000 adapters, empty cache, 2 bursts"
fi

# --- summary -----------------------------------------------------------------------------------------------------
{
  echo "# Cold start: $(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' || true
  "$py" -c "import os, torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}, {os.cpu_count()} CPUs')" 2>/dev/null || true
  echo "PRESET=$preset DTYPE=$dtype NUM_PROMPTS=$num (256 in / 128 out, all at once); SERVER_FLAGS=\"$common\". Part times: ${timings[*]/%/;}"
  echo
  "$py" -m benchmarks.cold_start_report "$out" --min-ratio "$min_ratio" --out "$out/results.json"
  if [ -f "$out/startup_probe.md" ]; then echo; echo "Start-up probe (benchmarks/startup_probe.py):"; cat "$out/startup_probe.md"; fi
} >"$out/results.md"
cat "$out/results.md"
