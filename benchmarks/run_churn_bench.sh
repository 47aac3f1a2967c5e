#!/usr/bin/env bash
# Many more adapters than fit the GPU, in one command (docs/benchmarks.md: "Many more adapters than fit the
# GPU" is S1, "Many adapters of mixed ranks, Zipf popularity" is S2):
#   S1: 2,000 rank-16 adapters, uniform, 1,000 requests 256/128, GPU pool 4 GB, host cache 16 GB, against the
#       same requests over 8 adapters (A-B-B-A on one server).
#   S2: 1,000 adapters of ranks 8/16/32/64, zipf:1.0, input 32:1024, output 16:256, GPU pool 4 GB, host cache
#       8 GB, against base-only on the same requests (A-B-B-A on one server), then the adapter mix at 60% of
#       its saturating request rate for the adapter-wait P99.
# Distinct adapter files: REAL per rank (default 16); adapter i is a directory symlink to real file set
# i mod (4 x REAL), so the server loads, validates and packs every adapter as its own, from the page cache.
#   usage: bash benchmarks/run_churn_bench.sh [OUT_DIR]     knobs: PARTS ("s1 s2"), NUM_PROMPTS, S1_ADAPTERS,
#   S2_ADAPTERS, REAL, PRESET, DEVICE, DTYPE, POOL_GB, S1_CACHE_GB, S2_CACHE_GB, SERVER_FLAGS, PYTHON,
#   S1_CAP_RUNNING (also run the 8-adapter requests with --max-running-requests this: the pool's ceiling),
#   S2_PASSES (default "base mix mix base"), S2_RATE_RUN (1: the 60% run; 0: skip it), METRICS_INTERVAL
#   (seconds between /metrics scrapes kept as each run's timeline; 0: none), BANDWIDTH_GBPS (the copy
#   bandwidth for each run's bytes floor and bound; default: probed once on CUDA, none elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${TMPDIR:-/tmp}/lorapipe-bench/churn_bench}")
py=${PYTHON:-python}
parts=${PARTS:-"s1 s2"} num=${NUM_PROMPTS:-1000} real=${REAL:-16}
n1=${S1_ADAPTERS:-2000} n2=${S2_ADAPTERS:-1000} pool_gb=${POOL_GB:-4}
cache1=${S1_CACHE_GB:-16} cache2=${S2_CACHE_GB:-8}
device=${DEVICE:-cuda} preset=${PRESET:-1b} dtype=${DTYPE:-bfloat16}
common=${SERVER_FLAGS:-"--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"}
port=${PORT:-27000}
scratch=${SCRATCH:-$out/scratch}
mkdir -p "$out" "$scratch"
model=$scratch/llama-$preset
[ -f "$model/config.json" ] || "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype "$dtype" --seed 0
# the device's copy bandwidth, once, before any server holds memory: each run's bytes floor and bound
roofline=() bw=${BANDWIDTH_GBPS:-}
[ -n "$bw" ] || [ "$device" != cuda ] || bw=$("$py" -m tools.roofline probe)
if [ -n "$bw" ]; then
  echo "device copy bandwidth: $bw GB/s" | tee "$out/bandwidth.txt"
  roofline=(--model "$model" --device-bandwidth "$bw")
fi

# real adapters (make_adapters cycles --ranks over them) and N names linked onto them
link_adapters() {  # $1 dir of links, $2 count, $3 real dir, $4 real count
  mkdir -p "$1"
  local i
  for ((i = 0; i < $2; i++)); do [ -e "$1/adapter$i" ] || ln -s "$3/adapter$((i % $4))" "$1/adapter$i"; done
}
server=
stop_server() { if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; wait "$server" || true; fi; server=; }
trap stop_server EXIT
start_server() {  # $1 label, $2 adapter dir, $3 count, rest: flags
  local label=$1 adir=$2 n=$3 i args=()
  shift 3
  for ((i = 0; i < n; i++)); do args+=(--adapter "adapter$i=$adir/adapter$i"); done
  local t0=$SECONDS
  # shellcheck disable=SC2086
  "$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" $common "$@" \
    --endpoint "tcp://127.0.0.1:$port" --metrics-port $((port + 1)) "${args[@]}" >"$out/server_$label.log" 2>&1 &
  server=$!
  for ((i = 0; ; i++)); do
    kill -0 "$server" 2>/dev/null || { echo "server $label exited; see $out/server_$label.log" >&2; exit 1; }
    "$py" -c "import sys; from runtime.client import Client
with Client(sys.argv[1], timeout=2.0) as c: sys.exit(0 if c.health().ok else 1)" "tcp://127.0.0.1:$port" 2>/dev/null && break
    [ "$i" -lt 900 ] || { echo "server $label not ready after 900 s" >&2; exit 1; }
    sleep 1
  done
  echo "$label: ready after $((SECONDS - t0)) s" | tee -a "$out/ready.txt"
}
bench() {  # $1 workload, $2 label, rest: extra args
  local w=$1 label=$2
  shift 2
  "$py" -m tools.bench_serving --endpoint "tcp://127.0.0.1:$port" --metrics-url "http://127.0.0.1:$((port + 1))/metrics" \
    --metrics-interval "${METRICS_INTERVAL:-0}" --workload "$w" --label "$label" --out "$out/$label.json" \
    "${roofline[@]}" "$@" | tail -26
}

case " $parts " in *" s1 "*)
  r16=$scratch/real16
  [ -f "$r16/adapter$((real - 1))/adapter_config.json" ] ||
    "$py" -m tools.make_adapters "$model" "$r16" --n "$real" --ranks 16 --targets all --dtype "$dtype" --seed 1
  link_adapters "$scratch/s1" "$n1" "$r16" "$real"
  g=(--num-prompts "$num" --input-len 256 --output-len 128 --request-rate inf --seed 0)
  "$py" -m tools.workload --out "$out/s1_many.jsonl" "${g[@]}" --num-adapters "$n1" --adapter-distribution uniform
  "$py" -m tools.workload --out "$out/s1_few.jsonl" "${g[@]}" --num-adapters 8 --adapter-distribution uniform
  start_server s1 "$scratch/s1" "$n1" --max-lora-rank 16 --lora-gpu-memory-gb "$pool_gb" --cpu-lora-cache-gb "$cache1"
  "$py" -m tools.bench_serving --endpoint "tcp://127.0.0.1:$port" --num-prompts 256 --input-len 256 \
    --output-len 128 --num-adapters 8 --seed 99 --quiet  # warm-up (kernels, graphs, allocator)
  bench "$out/s1_few.jsonl" s1_few_1
  bench "$out/s1_many.jsonl" s1_many_2
  bench "$out/s1_many.jsonl" s1_many_3
  bench "$out/s1_few.jsonl" s1_few_4
  stop_server
  if [ -n "${S1_CAP_RUNNING:-}" ]; then
    # the 8-adapter requests with the running batch capped near what the pool's adapters allow: the
    # ceiling a pool of POOL_GB puts on the 2,000-adapter run
    common_capped=$(echo " $common " | sed -E 's/ --max-running-requests [0-9]+ / /')
    common="$common_capped --max-running-requests $S1_CAP_RUNNING" start_server s1cap "$scratch/s1" 8 \
      --max-lora-rank 16 --lora-gpu-memory-gb "$pool_gb" --cpu-lora-cache-gb "$cache1"
    "$py" -m tools.bench_serving --endpoint "tcp://127.0.0.1:$port" --num-prompts 256 --input-len 256 \
      --output-len 128 --num-adapters 8 --seed 99 --quiet
    bench "$out/s1_few.jsonl" s1_few_capped
    stop_server
  fi
  ;;
esac

case " $parts " in *" s2 "*)
  rm=$scratch/realmix
  [ -f "$rm/adapter$((4 * real - 1))/adapter_config.json" ] ||
    "$py" -m tools.make_adapters "$model" "$rm" --n $((4 * real)) --ranks 8,16,32,64 --targets all --dtype "$dtype" --seed 2
  link_adapters "$scratch/s2" "$n2" "$rm" $((4 * real))
  g=(--num-prompts "$num" --input-len 32:1024 --output-len 16:256 --num-adapters "$n2" --adapter-distribution zipf:1.0 --seed 0)
  "$py" -m tools.workload --out "$out/s2_mix.jsonl" "${g[@]}" --request-rate inf
  "$py" -m tools.workload --out "$out/s2_base.jsonl" "${g[@]}" --request-rate inf --base-share 1.0
  start_server s2 "$scratch/s2" "$n2" --max-lora-rank 64 --lora-gpu-memory-gb "$pool_gb" --cpu-lora-cache-gb "$cache2"
  "$py" -m tools.bench_serving --endpoint "tcp://127.0.0.1:$port" --num-prompts 256 --input-len 32:1024 \
    --output-len 16:256 --num-adapters 8 --seed 99 --quiet  # warm-up
  k=0
  for pass in ${S2_PASSES:-base mix mix base}; do
    k=$((k + 1))
    bench "$out/s2_$pass.jsonl" "s2_${pass}_$k"
  done
  if [ "${S2_RATE_RUN:-1}" = 1 ]; then
    rate=$("$py" -c "import json,sys; s=[json.load(open(f))['summary'] for f in sys.argv[1:]]
print(round(0.6 * sorted(x['request_throughput'] for x in s)[len(s) // 2], 2))" "$out"/s2_mix_[0-9]*.json)
    "$py" -m tools.workload --out "$out/s2_mix_rate.jsonl" "${g[@]}" --request-rate "$rate"
    bench "$out/s2_mix_rate.jsonl" s2_mix_at_60pct
  fi
  stop_server
  ;;
esac

"$py" - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
from tools import roofline
out = Path(sys.argv[1])
runs = {f.stem: json.loads(f.read_text())["summary"] for f in sorted(out.glob("s[12]_*.json"))}
def med(names, key):
    xs = [runs[n][key] for n in names if n in runs]
    xs = [x["p50"] if isinstance(x, dict) else x for x in xs]
    return statistics.median(xs) if xs else None
print("| run | output tok/s | req/s | TTFT P50 s | adapter wait P99 s | loads disk→host | GPU hit rate |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for n, s in runs.items():
    print(f"| {n} | {s['output_throughput']:.0f} | {s['request_throughput']:.1f} | {s['ttft']['p50']:.3f} | "
          f"{s.get('adapter_wait_p99_s')} | {s.get('adapter_loads')} | {s.get('gpu_slot_hit_rate')} |")
res = {}
many, few = ("s1_many_2", "s1_many_3"), ("s1_few_1", "s1_few_4")
mix = [n for n in runs if n.startswith("s2_mix_") and n[7:].isdigit()]
base = [n for n in runs if n.startswith("s2_base_")]
if med(many, "output_throughput") and med(few, "output_throughput"):
    res["s1_ratio"] = med(many, "output_throughput") / med(few, "output_throughput")
if med(mix, "output_throughput") and med(base, "output_throughput"):
    res["s2_throughput_ratio"] = med(mix, "output_throughput") / med(base, "output_throughput")
    res["s2_ttft_ratio"] = med(mix, "ttft") / med(base, "ttft")
def bound(names, bases):
    """Median over run/baseline pairs of the best ratio the runs' bytes allow (tools/roofline.py)."""
    xs = [roofline.bound_ratio(runs[n]["roofline"], runs[n]["output_tokens"], runs[b]["roofline"],
                               runs[b]["output_tokens"], runs[b]["duration_s"])
          for n in names for b in bases if runs.get(n, {}).get("roofline") and runs.get(b, {}).get("roofline")]
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
for key, names, bases in (("s1", many, few), ("s2", mix, base)):
    ratio = res.get(f"{key}_ratio" if key == "s1" else "s2_throughput_ratio")
    b = bound(names, bases)
    if b is not None:
        res[f"{key}_bytes_bound"] = b
        res[f"{key}_fraction_of_bound"] = roofline.fraction_of_bound(ratio, b)
if "s2_mix_at_60pct" in runs:
    res["s2_adapter_wait_p99_s"] = runs["s2_mix_at_60pct"].get("adapter_wait_p99_s")
print(json.dumps(res, indent=1))
(out / "churn_summary.json").write_text(json.dumps({"ratios": res, "runs": runs}, indent=1, default=str))
EOF
