#!/usr/bin/env bash
# The whole GPU benchmark of docs/benchmarks.md in one command: Llama-3.2-1B-shaped model + 32 rank-16
# adapters, lorapipe rate sweep and base-only run, then PEFT at batch 8/32/64 and plain transformers.
#   usage: bash benchmarks/run_gpu_bench.sh [OUT_DIR]     (knobs: the environment variables below; COMMIT names the
#   commit in the tables where the tree is a copy without git's HEAD)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${TMPDIR:-/tmp}/lorapipe-bench/gpu_bench}")
py=${PYTHON:-python}
scratch=${SCRATCH:-$out/scratch}     # model and adapters (about 2.5 GB + 32 x 22 MB)
rates=${RATES:-"1 2 4 8 16 32 64 inf"} # req/s; inf = everything arrives at once (saturation)
num=${NUM_PROMPTS:-500}
nad=${NUM_ADAPTERS:-32}
peft_batches=${PEFT_BATCHES:-"8 32 64"}
peft_limit=${PEFT_LIMIT:-}             # e.g. 128: PEFT runs only the first N requests (it is slow)
parts=${PARTS:-"lorapipe peft"}        # run a subset (e.g. one per call); tables use whatever results exist
port=${PORT:-28000}
seed=${SEED:-0}
server_flags=${SERVER_FLAGS:-"--max-loras-per-batch 32 --max-cpu-loras 32 --max-lora-rank 16 --max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192"}
endpoint=tcp://127.0.0.1:$port
metrics=http://127.0.0.1:$((port + 1))/metrics
mkdir -p "$out" "$scratch"
device=${DEVICE:-cuda} preset=${PRESET:-1b} dtype=${DTYPE:-bfloat16}  # cpu/tiny/float32: a smoke test
has_mpl=$("$py" -c "import matplotlib" 2>/dev/null && echo 1 || true)

# --- model, adapters, workloads (same seed: the same 500 requests at every rate) ---------------------
model=$scratch/llama-$preset adir=$scratch/adapters
[ -f "$model/config.json" ] || "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype "$dtype" --seed 0
[ -f "$adir/adapter$((nad - 1))/adapter_config.json" ] ||
  "$py" -m tools.make_adapters "$model" "$adir" --n "$nad" --ranks 16 --targets all --dtype "$dtype" --seed 0
gen=(--num-prompts "$num" --input-len 256 --output-len 128 --num-adapters "$nad" --seed "$seed")
for r in $rates inf; do  # inf: the saturating workload PEFT also runs
  "$py" -m tools.workload --out "$out/workload_r$r.jsonl" "${gen[@]}" --request-rate "$r" --adapter-distribution uniform
done
"$py" -m tools.workload --out "$out/workload_base.jsonl" "${gen[@]}" --request-rate inf --base-share 1.0

# --- lorapipe -----------------------------------------------------------------------------------------
run_lorapipe() {
  local adapter_args=() i r plot
  for ((i = 0; i < nad; i++)); do adapter_args+=(--adapter "adapter$i=$adir/adapter$i"); done
  # shellcheck disable=SC2086  # server_flags is a list of flags
  "$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" $server_flags \
    --endpoint "$endpoint" --metrics-port $((port + 1)) "${adapter_args[@]}" >"$out/server.log" 2>&1 &
  server=$!
  for ((i = 0; ; i++)); do
    kill -0 "$server" 2>/dev/null || { echo "lorapipe serve exited; see $out/server.log" >&2; exit 1; }
    "$py" -c "import sys; from runtime.client import Client
with Client(sys.argv[1], timeout=2.0) as c: sys.exit(0 if c.health().ok else 1)" "$endpoint" 2>/dev/null && break
    [ "$i" -lt 900 ] || { echo "lorapipe serve not ready after 900 s" >&2; exit 1; }
    sleep 1
  done
  local bench=("$py" -m tools.bench_serving --endpoint "$endpoint" --metrics-url "$metrics")
  "${bench[@]}" --num-prompts 64 --input-len 256 --output-len 128 --num-adapters "$nad" --quiet --seed 999
  for r in $rates; do
    plot=()
    [ -z "$has_mpl" ] || plot=(--plot "$out/lorapipe_r$r.png")
    "${bench[@]}" --workload "$out/workload_r$r.jsonl" --label "lorapipe r=$r" --out "$out/lorapipe_r$r.json" "${plot[@]}"
  done
  "${bench[@]}" --workload "$out/workload_base.jsonl" --label "lorapipe base-only" --out "$out/lorapipe_base.json"
  "$py" -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "$metrics" >"$out/server_metrics.txt" # every stage's counters and histograms after the whole run
  stop_server # frees the GPU for PEFT
}
server=
stop_server() { if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; wait "$server" || true; fi; }
trap stop_server EXIT

# --- transformers + PEFT on the saturating workload (every request arrives at 0) ----------------------
run_peft() {
  local b peft=("$py" -m benchmarks.bench_peft --workload "$out/workload_rinf.jsonl" --model "$model"
    --device "$device" --dtype "$dtype" ${peft_limit:+--limit "$peft_limit"})
  for b in $peft_batches; do
    "${peft[@]}" --adapter-dir "$adir" --batch-size "$b" --out "$out/peft_bs$b.json"
  done
  "${peft[@]}" --no-adapters --batch-size 32 --out "$out/transformers_base_bs32.json"
}

case " $parts " in *" lorapipe "*) run_lorapipe ;; esac
case " $parts " in *" peft "*) run_peft ;; esac

# --- tables (from whatever results exist) ---------------------------------------------------------------
existing() { local f; for f in "$@"; do [ ! -f "$f" ] || echo "$f"; done; }
table() { # JSON files..., then the baseline (used only if it exists)
  local base=${*: -1} files
  mapfile -t files < <(existing "${@:1:$#-1}")
  [ "${#files[@]}" -gt 0 ] || { echo "_no results_"; return; }
  "$py" -m tools.bench_report "${files[@]}" $([ -f "$base" ] && echo --baseline "$base")
}
sweep=()
for r in $rates; do sweep+=("$out/lorapipe_r$r.json"); done
baselines=("$out/lorapipe_r${rates##* }.json" "$out/lorapipe_base.json")
for b in $peft_batches; do baselines+=("$out/peft_bs$b.json"); done
{
  echo "# lorapipe vs PEFT: $(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' || true
  "$py" -c "import torch, transformers, peft; print(f'torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}')"
  echo "PEFT requests: ${peft_limit:-all $num}; server flags: $server_flags"
  echo
  echo "## Rate sweep ($nad adapters, uniform, 256 in / 128 out, $num requests); × = output tok/s over lorapipe base-only"
  echo
  table "${sweep[@]}" "$out/lorapipe_base.json" "$out/lorapipe_base.json"
  echo
  echo "## Baselines; × = output tok/s over plain transformers generate at batch 32"
  echo
  table "${baselines[@]}" "$out/transformers_base_bs32.json" "$out/transformers_base_bs32.json"
} >"$out/results.md"
cat "$out/results.md"
