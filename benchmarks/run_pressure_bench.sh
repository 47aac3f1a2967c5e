#!/usr/bin/env bash
# The memory-pressure targets in one call: a Llama-3.2-1B-shaped model, 96 adapters of ranks 8/16/32/64, Zipf
# 1.1, 32-1,024 in / 16-256 out, a GPU adapter pool of 1.45 GB, on the same build:
#   tight: a host cache of 2.2 GB (about half the adapters); roomy: a host cache that holds all of them.
#   Saturation passes of 1,000 requests (all at once) in the order tight, roomy, roomy, tight, then the
#   same requests at 40 req/s offered on the tight server.
# Targets: every tight request succeeds; tight output tok/s >= 0.9x roomy (median of each's two passes);
# at 40 req/s, P99 TTFT <= 1 s and no failure. Both servers stay up side by side (each started once,
# explicit KV pages so they share the GPU) and share one compile cache; both get the same warm-up, which
# touches every adapter (the roomy cache then holds them all). Every wait is bounded: a pass that hangs
# ends by the per-reply timeout (its stranded requests fail with Timeout and are counted as not finished)
# or is cut at PASS_TIMEOUT_S (the count read from its progress line); a tight server that hung gets no
# further passes, and a pass that no longer fits in BUDGET_S is skipped and reported as such.
# Writes OUT_DIR/summary.md (the table, also printed) and summary.json, the bench JSONs and server logs.
#   usage: bash benchmarks/run_pressure_bench.sh OUT_DIR      (knobs: the variables below)
#   CPU plumbing check: DEVICE=cpu PRESET=tiny DTYPE=float32 NUM_ADAPTERS=12 REAL=1 NUM_PROMPTS=40 \
#     INPUT_LEN=4:48 OUTPUT_LEN=2:16 RATE=20 POOL_GB=0.002 TIGHT_CACHE_GB=0.004 \
#     SERVER_FLAGS="--max-lora-rank 64 --num-pages 1024 --port 0" bash benchmarks/run_pressure_bench.sh /tmp/pb
#   CPU under pressure (a tight cache of about 3 rank-64 adapters, a pool of 2, 40 adapters): the same with
#     NUM_ADAPTERS=40 REAL=2 NUM_PROMPTS=240 RATE=40 POOL_GB=0.0011 TIGHT_CACHE_GB=0.0016 PASS_TIMEOUT_S=60
#     REPLY_TIMEOUT_S=20 SERVER_FLAGS="--max-lora-rank 64 --num-pages 2048 --port 0"
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: bash benchmarks/run_pressure_bench.sh OUT_DIR}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
py=${PYTHON:-python}
# model, adapters and the compile cache, reused when complete (1b: about 2.5 GB + 1.4 GB); outside OUT_DIR,
# so that a device call's $OUT/... output folder brings back only results and logs
scratch=${SCRATCH:-${TMPDIR:-/tmp}/lorapipe_pressure_scratch}
device=${DEVICE:-cuda} preset=${PRESET:-1b} dtype=${DTYPE:-bfloat16}
nad=${NUM_ADAPTERS:-96} real=${REAL:-8}   # adapter names link onto REAL distinct adapters per rank
num=${NUM_PROMPTS:-1000} rate=${RATE:-40} dist=${DIST:-zipf:1.1} seed=${SEED:-0}
in_len=${INPUT_LEN:-32:1024} out_len=${OUTPUT_LEN:-16:256}
pool_gb=${POOL_GB:-1.45} tight_gb=${TIGHT_CACHE_GB:-2.2} roomy_gb=${ROOMY_CACHE_GB:-}  # roomy: computed
# 24,576 pages of 16 tokens (12 GiB on 1b) each: 256 running requests of up to 1,280 tokens fit, and two
# servers fit one 80 GB GPU (without --num-pages the first one would take the free memory)
server_flags=${SERVER_FLAGS:-"--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --num-pages 24576 --port 0"}
budget=${BUDGET_S:-540}             # the whole script, start-ups included
pass_timeout=${PASS_TIMEOUT_S:-150} # one pass, at most
reply_timeout=${REPLY_TIMEOUT_S:-90} # bench_serving's wait for any one reply (a first token at saturation too)
ready_timeout=${READY_TIMEOUT_S:-300}
port=${PORT:-27400}
mkdir -p "$out" "$scratch"
t_start=$SECONDS
note() { echo "[$((SECONDS - t_start)) s] $*" | tee -a "$out/progress.txt"; }

# --- model, adapters (beside the model's weights, once its config exists), workloads ---------------------------
model=$scratch/llama-$preset-$dtype radir=$scratch/real-$preset-$dtype-r$real adir=$scratch/links-$preset-$dtype-$nad-r$real
maker=
if [ ! -f "$model/.complete" ]; then
  rm -rf "$model"
  "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype "$dtype" --seed 0 >"$out/make_model.log" 2>&1 &
  maker=$!
fi
for ((i = 0; i < 600; i++)); do [ -f "$model/config.json" ] && break; sleep 0.1; done  # written before the weights
if [ ! -f "$radir/.complete" ]; then
  rm -rf "$radir"
  "$py" -m tools.make_adapters "$model" "$radir" --n $((4 * real)) --ranks 8,16,32,64 --targets all \
    --dtype "$dtype" --seed 2 >/dev/null
  touch "$radir/.complete"
fi
if [ -n "$maker" ]; then
  wait "$maker" || { echo "make_tiny_model failed; see $out/make_model.log" >&2; exit 1; }
  touch "$model/.complete"
fi
mkdir -p "$adir"
adapters=()
for ((i = 0; i < nad; i++)); do  # adapter i has rank (8, 16, 32, 64)[i % 4]
  [ -e "$adir/adapter$i" ] || ln -s "$radir/adapter$((i % (4 * real)))" "$adir/adapter$i"
  adapters+=(--adapter "adapter$i=$adir/adapter$i")
done
g=(--num-prompts "$num" --input-len "$in_len" --output-len "$out_len" --num-adapters "$nad"
  --adapter-distribution "$dist" --seed "$seed")
"$py" -m tools.workload --out "$out/saturation.jsonl" "${g[@]}" --request-rate inf >/dev/null
"$py" -m tools.workload --out "$out/rate.jsonl" "${g[@]}" --request-rate "$rate" >/dev/null
# the warm-up: every adapter twice, short requests
"$py" -m tools.workload --out "$out/warmup.jsonl" --num-prompts $((2 * nad)) --input-len 64 --output-len 16 \
  --num-adapters "$nad" --adapter-distribution distinct --seed 99 --request-rate inf >/dev/null
if [ -z "$roomy_gb" ]; then
  # room for every adapter even if each reserved a block of the largest rank (a staging may reserve that
  # much before the adapter's rank is known), plus 5%: the roomy cache never has to evict
  roomy_gb=$("$py" - "$model" "$adir" "$nad" "$dtype" <<'EOF'
import json, sys
from pathlib import Path
from runtime.common.host_pool import ALIGN
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, parse_dtype
model, adir, n, dtype = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ranks = [json.loads((adir / f"adapter{i}" / "adapter_config.json").read_text())["r"] for i in range(n)]
cfg = ModelConfig.from_dir(model)
block = LoraLayout.for_model(cfg, max(ranks)).block_bytes(max(ranks), parse_dtype(dtype, cfg.dtype))
print(f"{1.05 * n * (-(-block // ALIGN) * ALIGN) / 2**30:.4f}")
EOF
  )
fi
note "model, $nad adapters (over $((4 * real)) distinct), workloads ready; roomy host cache $roomy_gb GiB"

# --- both servers, side by side, one compile cache -------------------------------------------------------------
declare -A pid endpoint metrics launched
start_server() { # NAME PORT CACHE_GB: starts in the background
  local name=$1 p=$2
  launched[$name]=$(date +%s.%N)
  endpoint[$name]=tcp://127.0.0.1:$p metrics[$name]=http://127.0.0.1:$((p + 1))/metrics
  # shellcheck disable=SC2086  # server_flags is a list of flags
  "$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" $server_flags "${adapters[@]}" \
    --lora-gpu-memory-gb "$pool_gb" --cpu-lora-cache-gb "$3" --compile-cache-dir "$scratch/compile_cache" \
    --startup-timeout "$ready_timeout" --endpoint "${endpoint[$name]}" --metrics-port $((p + 1)) \
    >"$out/server_$name.log" 2>&1 &
  pid[$name]=$!
}
stop_servers() {
  local name
  for name in "${!pid[@]}"; do kill -TERM "${pid[$name]}" 2>/dev/null || true; done
  for name in "${!pid[@]}"; do  # drain-timeout (30 s) and a margin, then kill
    timeout 60 tail --pid="${pid[$name]}" -f /dev/null || kill -KILL "${pid[$name]}" 2>/dev/null || true
  done
}
trap stop_servers EXIT
start_server tight "$port" "$tight_gb"
start_server roomy $((port + 2)) "$roomy_gb"
for name in tight roomy; do
  ready=$("$py" -m tools.wait_ready "${endpoint[$name]}" --pid "${pid[$name]}" --timeout "$ready_timeout" \
    --since "${launched[$name]}") || {
    echo "$name server not ready; see $out/server_$name.log" >&2
    tail -n 20 "$out/server_$name.log" >&2
    exit 1
  }
  note "$name server ready $ready s after its launch"
done

# --- passes -------------------------------------------------------------------------------------------------
: >"$out/passes.tsv"
declare -A hung
bench() { # LABEL SERVER WORKLOAD: one bounded pass -> OUT/LABEL.json, or a line saying why not
  local label=$1 name=$2 w=$3 left limit rc=0
  rm -f "$out/$label".{json,txt,progress}  # an earlier run's files into the same OUT_DIR
  left=$((budget - (SECONDS - t_start) - 70))  # room for the rest: shutdown and the report
  if [ -n "${hung[$name]:-}" ]; then
    printf '%s\t%s\tskipped: the %s server did not finish %s\n' "$label" "$name" "$name" "${hung[$name]}" >>"$out/passes.tsv"
    note "$label skipped: $name did not finish ${hung[$name]}"
    return
  fi
  if [ "$left" -lt 30 ]; then
    printf '%s\t%s\tskipped: out of time (%s s of BUDGET_S=%s left)\n' "$label" "$name" "$((budget - SECONDS + t_start))" "$budget" >>"$out/passes.tsv"
    note "$label skipped: out of time"
    return
  fi
  limit=$((left < pass_timeout ? left : pass_timeout))
  local t0=$SECONDS
  timeout -k 10 "$limit" "$py" -m tools.bench_serving --endpoint "${endpoint[$name]}" --metrics-url "${metrics[$name]}" \
    --metrics-interval 0 --workload "$w" --label "$label" --out "$out/$label.json" \
    --request-timeout "$reply_timeout" >"$out/$label.txt" 2>"$out/$label.progress" || rc=$?
  local status=ok
  if [ "$rc" -ne 0 ]; then
    status="cut at $limit s (exit $rc)"
  elif "$py" -c "import json,sys; r=json.load(open(sys.argv[1]))['requests']
sys.exit(any((x['error'] or '').startswith('Timeout') for x in r))" "$out/$label.json"; then
    :
  else
    status=hung
  fi
  [ "$status" = ok ] || hung[$name]=$label
  printf '%s\t%s\t%s\n' "$label" "$name" "$status" >>"$out/passes.tsv"
  note "$label on $name: $status after $((SECONDS - t0)) s"
}
for name in tight roomy; do  # not a measured pass: kernels, graphs, allocator, every adapter staged once
  bench "warmup_$name" "$name" "$out/warmup.jsonl"
done
bench p1_tight tight "$out/saturation.jsonl"
bench p2_roomy roomy "$out/saturation.jsonl"
bench p3_roomy roomy "$out/saturation.jsonl"
bench p4_tight tight "$out/saturation.jsonl"
bench "p5_tight_${rate}rps" tight "$out/rate.jsonl"
stop_servers
trap - EXIT

# --- summary -----------------------------------------------------------------------------------------------
{
  echo "# Adapters under memory pressure: $(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' || true
  echo "PRESET=$preset DTYPE=$dtype NUM_ADAPTERS=$nad (ranks 8/16/32/64 over $((4 * real)) distinct files)" \
    "NUM_PROMPTS=$num ($in_len in / $out_len out, $dist) POOL_GB=$pool_gb host cache tight $tight_gb GiB," \
    "roomy $roomy_gb GiB; SERVER_FLAGS=\"$server_flags\"; $((SECONDS - t_start)) s in all"
  echo
  "$py" -m benchmarks.pressure_report "$out" --rate "$rate" || true  # exit 1: a target not met
} >"$out/summary.md"
cat "$out/summary.md"
