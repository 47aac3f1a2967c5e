#!/usr/bin/env bash
# The large-adapter overlap scenario ("Large adapters loaded while serving" in docs/benchmarks.md) on two
# builds side by side: an 8B-shaped model, 32 rank-64 adapters of 335 MB, a GPU pool of 8, distinct
# adapters, 128 in / 32 out, Poisson 8 req/s, overlapped loading. Build A is OLD_TREE (a copy of another
# commit's runtime/ stages/ kernels/ proto/ tools/, e.g. `git archive 643ec33 runtime stages kernels proto
# tools | tar -x -C OLD_TREE`), build B this checkout. Both servers stay up at once (explicit KV pages),
# each driven by its own build's tools (the client protocol may differ), in the order A, B, B, A.
#   usage: bash benchmarks/run_overlap_ab.sh OLD_TREE OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
old=$(realpath "${1:?usage: run_overlap_ab.sh OLD_TREE OUT_DIR}")
out=$(realpath -m "${2:?usage: run_overlap_ab.sh OLD_TREE OUT_DIR}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
py=${PYTHON:-python3}
scratch=${SCRATCH:-${TMPDIR:-/tmp}/lorapipe_overlap_scratch}
preset=${PRESET:-8b} device=${DEVICE:-cuda}  # PRESET=tiny DEVICE=cpu: a plumbing check
nad=32 rank=64 slots=8 rate=${RATE:-8} num=${NUM_PROMPTS:-120} warm=${WARMUP_PROMPTS:-128} seed=0
flags=(--max-model-len "${MAX_MODEL_LEN:-2048}" --lora-gpu-memory-gb 2.7 --max-loras-per-batch "$slots" --max-cpu-loras "$nad"
  --max-lora-rank "$rank" --num-pages 4096 --port 0 --device "$device" --dtype bfloat16)
mkdir -p "$out" "$scratch"
model=$scratch/llama-$preset adir=$scratch/adapters-$preset-r$rank-n$nad
if [ ! -f "$model/.complete" ]; then
  rm -rf "$model"
  "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype bfloat16 --seed 0 && touch "$model/.complete"
fi
if [ ! -f "$adir/.complete" ]; then
  rm -rf "$adir"
  "$py" -m tools.make_adapters "$model" "$adir" --n "$nad" --ranks "$rank" --targets all --dtype bfloat16 \
    --seed 0 >/dev/null && touch "$adir/.complete"
fi
adapters=()
for ((i = 0; i < nad; i++)); do adapters+=(--adapter "adapter$i=$adir/adapter$i"); done
gen=(--num-adapters "$nad" --adapter-distribution distinct --input-len 128 --output-len 32)

pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait' EXIT
start() { # NAME TREE PORT
  local p=$3
  (cd "$2" && exec "$py" -m runtime.cli serve --model "$model" "${flags[@]}" "${adapters[@]}" \
    --endpoint "tcp://127.0.0.1:$p" --metrics-port $((p + 1)) >"$out/server_$1.log" 2>&1) &
  pids+=($!)
  (cd "$2" && "$py" -m tools.workload --out "$out/$1_r$rate.jsonl" "${gen[@]}" --num-prompts "$num" \
    --request-rate "$rate" --seed "$seed" && "$py" -m tools.workload --out "$out/$1_warmup.jsonl" "${gen[@]}" \
    --num-prompts "$warm" --seed $((seed + 999)))
}
ready() { # TREE PORT PID
  local i
  for ((i = 0; i < 600; i++)); do
    kill -0 "$3" 2>/dev/null || { echo "the server at port $2 exited; see its log" >&2; return 1; }
    (cd "$1" && "$py" -c "import sys; from runtime.client import Client
with Client(sys.argv[1], timeout=2.0) as c: sys.exit(0 if c.health().ok else 1)" "tcp://127.0.0.1:$2") 2>/dev/null \
      && return 0
    sleep 1
  done
  echo "server at port $2 not ready" >&2
  return 1
}
bench() { # NAME TREE PORT TAG
  (cd "$2" && "$py" -m tools.bench_serving --endpoint "tcp://127.0.0.1:$3" --metrics-url "http://127.0.0.1:$(($3 + 1))/metrics" \
    --workload "$out/$1_r$rate.jsonl" --label "$1 $4" --out "$out/$1_$4.json")
}
start A "$old" 28200
start B "$PWD" 28210
ready "$old" 28200 "${pids[0]}" && ready "$PWD" 28210 "${pids[1]}"
(cd "$old" && "$py" -m tools.bench_serving --endpoint tcp://127.0.0.1:28200 --workload "$out/A_warmup.jsonl" --quiet)
"$py" -m tools.bench_serving --endpoint tcp://127.0.0.1:28210 --workload "$out/B_warmup.jsonl" --quiet
bench A "$old" 28200 1
bench B "$PWD" 28210 1
bench B "$PWD" 28210 2
bench A "$old" 28200 2
cmp -s "$out/A_r$rate.jsonl" "$out/B_r$rate.jsonl" || echo "note: the two builds' workload files differ" >&2
"$py" - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
print("| build | run | completed | TTFT P50 / P95 ms | E2E P50 ms | output tok/s |")
print("| --- | --- | --- | --- | --- | --- |")
med = {}
for b, name in (("A", "old"), ("B", "this")):
    for k in (1, 2):
        s = json.load(open(f"{out}/{b}_{k}.json"))["summary"]
        med.setdefault(b, []).append(s["ttft"]["p50"])
        print(f"| {b} ({name}) | {k} | {s['completed']}/{s['num_requests']} | {s['ttft']['p50'] * 1e3:.2f} / "
              f"{s['ttft']['p95'] * 1e3:.2f} | {s['e2e']['p50'] * 1e3:.2f} | {s['output_throughput']:.1f} |")
a, b = statistics.median(med["A"]), statistics.median(med["B"])
print(f"\nmedian TTFT P50: A {a * 1e3:.2f} ms, B {b * 1e3:.2f} ms, B/A {b / a:.3f}")
PY
