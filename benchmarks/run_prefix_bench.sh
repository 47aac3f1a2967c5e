#!/usr/bin/env bash
# Prefix caching's targets in one call, on one build: two servers side by side, `cached` (the default) and
# `plain` (--no-prefix-caching), a Llama-3.2-1B-shaped model and 50 adapters of rank 16 (names linked onto
# REAL distinct files; the cache keys by name, so each name has prefixes of its own).
#   prefix: 1,000 requests all at once, adapters Zipf 1.0, each adapter's own 1,024-token system prompt +
#     a 64-256-token user suffix, 128 tokens out. Targets: cached/plain output tok/s >= 2.5, TTFT P50 <= 0.3.
#   distinct: no shared prefix (64-1,024 in, 128 out, the same adapters), A-B-B-A (cached, plain, plain,
#     cached). Target: cached within 2 % of plain (median of each one's two passes).
# Every pass of a pair replays the same requests on both servers; each pair has prompts of its own (another
# seed), so a server never finds a pass's prompts cached by an earlier pass. Both servers get the same
# warm-up, whose system prompts differ from every pass's. Writes OUT_DIR/summary.md (the table, also
# printed) and summary.json, the bench JSONs and the server logs.
#   usage: bash benchmarks/run_prefix_bench.sh OUT_DIR                          (knobs: the variables below)
#   CPU plumbing check: DEVICE=cpu PRESET=tiny DTYPE=float32 NUM_PROMPTS=24 DISTINCT_PROMPTS=12 PREFIX=64 \
#     SUFFIX=4:16 OUTPUT_LEN=4 DISTINCT_LEN=8:64 POOL_GB=0.01 \
#     SERVER_FLAGS="--max-model-len 512 --num-pages 4096 --port 0" bash benchmarks/run_prefix_bench.sh /tmp/pfx
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: bash benchmarks/run_prefix_bench.sh OUT_DIR}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
py=${PYTHON:-python}
# model, adapters and the compile cache, reused when complete; outside OUT_DIR (results and logs only there)
scratch=${SCRATCH:-${TMPDIR:-/tmp}/lorapipe_prefix_scratch}
device=${DEVICE:-cuda} preset=${PRESET:-1b} dtype=${DTYPE:-bfloat16}
nad=${NUM_ADAPTERS:-50} real=${REAL:-10} rank=${RANK:-16}
num=${NUM_PROMPTS:-1000} prefix=${PREFIX:-1024} suffix=${SUFFIX:-64:256} out_len=${OUTPUT_LEN:-128}
dist=${DIST:-zipf:1.0} distinct_num=${DISTINCT_PROMPTS:-500} distinct_len=${DISTINCT_LEN:-64:1024}
pool_gb=${POOL_GB:-2}
# 24,576 pages of 16 tokens (12 GiB on 1b) each: 256 running requests of up to 1,408 tokens fit without
# sharing a page (the plain server's case), and two servers share one 80 GB GPU
server_flags=${SERVER_FLAGS:-"--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --num-pages 24576 --port 0"}
pass_timeout=${PASS_TIMEOUT_S:-120} reply_timeout=${REPLY_TIMEOUT_S:-90} ready_timeout=${READY_TIMEOUT_S:-300}
port=${PORT:-27600}
mkdir -p "$out" "$scratch"
t_start=$SECONDS
note() { echo "[$((SECONDS - t_start)) s] $*" | tee -a "$out/progress.txt"; }

# --- model, adapters, workloads ----------------------------------------------------------------------------------
model=$scratch/llama-$preset-$dtype radir=$scratch/real-$preset-$dtype-r$rank-n$real adir=$scratch/links-$nad-r$real
if [ ! -f "$model/.complete" ]; then
  rm -rf "$model"
  "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype "$dtype" --seed 0 >"$out/make_model.log" 2>&1
  touch "$model/.complete"
fi
if [ ! -f "$radir/.complete" ]; then
  rm -rf "$radir"
  "$py" -m tools.make_adapters "$model" "$radir" --n "$real" --ranks "$rank" --targets all --dtype "$dtype" \
    --seed 3 >/dev/null
  touch "$radir/.complete"
fi
mkdir -p "$adir"
adapters=()
for ((i = 0; i < nad; i++)); do
  [ -e "$adir/adapter$i" ] || ln -s "$radir/adapter$((i % real))" "$adir/adapter$i"
  adapters+=(--adapter "adapter$i=$adir/adapter$i")
done
g=(--num-adapters "$nad" --adapter-distribution "$dist" --output-len "$out_len" --request-rate inf)
for s in 1 2; do
  "$py" -m tools.workload --out "$out/prefix_$s.jsonl" "${g[@]}" --num-prompts "$num" --shared-prefix "$prefix" \
    --input-len "$suffix" --seed "$s" >/dev/null
  "$py" -m tools.workload --out "$out/distinct_$s.jsonl" "${g[@]}" --num-prompts "$distinct_num" \
    --input-len "$distinct_len" --seed $((s + 10)) >/dev/null
done
# warm-up: every adapter twice, prefixes of their own (another seed), short outputs
"$py" -m tools.workload --out "$out/warmup.jsonl" --num-adapters "$nad" --adapter-distribution distinct \
  --num-prompts $((2 * nad)) --shared-prefix "$prefix" --input-len "$suffix" --output-len 16 --seed 99 >/dev/null
note "model, $nad adapters (over $real distinct files) and workloads ready"

# --- both servers, side by side, one compile cache ----------------------------------------------------------------
declare -A pid endpoint metrics launched
start_server() { # NAME PORT FLAG...: starts in the background
  local name=$1 p=$2
  shift 2
  launched[$name]=$(date +%s.%N)
  endpoint[$name]=tcp://127.0.0.1:$p metrics[$name]=http://127.0.0.1:$((p + 1))/metrics
  # shellcheck disable=SC2086  # server_flags is a list of flags
  "$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" $server_flags "${adapters[@]}" \
    --lora-gpu-memory-gb "$pool_gb" --max-lora-rank "$rank" --compile-cache-dir "$scratch/compile_cache" \
    --startup-timeout "$ready_timeout" --endpoint "${endpoint[$name]}" --metrics-port $((p + 1)) "$@" \
    >"$out/server_$name.log" 2>&1 &
  pid[$name]=$!
}
stop_servers() {
  local name
  for name in "${!pid[@]}"; do kill -TERM "${pid[$name]}" 2>/dev/null || true; done
  for name in "${!pid[@]}"; do
    timeout 60 tail --pid="${pid[$name]}" -f /dev/null || kill -KILL "${pid[$name]}" 2>/dev/null || true
  done
}
trap stop_servers EXIT
start_server cached "$port"
start_server plain $((port + 2)) --no-prefix-caching
for name in cached plain; do
  ready=$("$py" -m tools.wait_ready "${endpoint[$name]}" --pid "${pid[$name]}" --timeout "$ready_timeout" \
    --since "${launched[$name]}") || {
    echo "$name server not ready; see $out/server_$name.log" >&2
    tail -n 20 "$out/server_$name.log" >&2
    exit 1
  }
  note "$name server ready $ready s after its launch"
done

# --- passes (each bounded) -------------------------------------------------------------------------------------------
: >"$out/passes.tsv"
bench() { # LABEL SERVER WORKLOAD -> OUT/LABEL.json and the server's metrics after it (OUT/LABEL.metrics)
  local label=$1 name=$2 rc=0 t0=$SECONDS
  timeout -k 10 "$pass_timeout" "$py" -m tools.bench_serving --endpoint "${endpoint[$name]}" \
    --metrics-url "${metrics[$name]}" --metrics-interval 0 --workload "$3" --label "$label" --out "$out/$label.json" \
    --request-timeout "$reply_timeout" >"$out/$label.txt" 2>"$out/$label.progress" || rc=$?
  "$py" -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())" \
    "${metrics[$name]}" 2>/dev/null | grep -E '^lorapipe_(prefix_cache|kv_pages|preemptions)' >"$out/$label.metrics" || true
  printf '%s\t%s\t%s\n' "$label" "$name" "$([ "$rc" -eq 0 ] && echo ok || echo "exit $rc")" >>"$out/passes.tsv"
  note "$label on $name: exit $rc after $((SECONDS - t0)) s"
}
for name in cached plain; do bench "warmup_$name" "$name" "$out/warmup.jsonl"; done
bench distinct_1_cached cached "$out/distinct_1.jsonl"
bench distinct_1_plain plain "$out/distinct_1.jsonl"
bench distinct_2_plain plain "$out/distinct_2.jsonl"
bench distinct_2_cached cached "$out/distinct_2.jsonl"
bench prefix_1_cached cached "$out/prefix_1.jsonl"
bench prefix_1_plain plain "$out/prefix_1.jsonl"
if [ "${PREFIX_PASSES:-2}" -ge 4 ]; then  # A-B-B-A for the prefix workload too (about 2 minutes more on an H100)
  bench prefix_2_plain plain "$out/prefix_2.jsonl"
  bench prefix_2_cached cached "$out/prefix_2.jsonl"
fi
stop_servers
trap - EXIT

{
  echo "# Prefix caching per adapter: $(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' || true
  echo "PRESET=$preset DTYPE=$dtype $nad adapters of rank $rank (over $real files), $dist; prefix: $num requests," \
    "$prefix-token system prompts + $suffix suffixes, $out_len out; distinct: $distinct_num requests, $distinct_len" \
    "in; SERVER_FLAGS=\"$server_flags\"; $((SECONDS - t_start)) s in all"
  echo
  "$py" -m benchmarks.prefix_report "$out" || true  # exit 1: a target not met
} >"$out/summary.md"
cat "$out/summary.md"
