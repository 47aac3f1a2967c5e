#!/usr/bin/env bash
# Tensor parallelism on a two-GPU machine ("Tensor parallel" in docs/benchmarks.md): the hand-over of a
# step from rank 0 to rank 1 on the host (gloo against the ZeroMQ channel); the all-reduce paths by
# message size; the offline engine's decode throughput at TP=1 and TP=2, A-B-B-A, base-only and
# with 4 rank-16 adapters, batch 16 and 64 (8B-shaped) and 64 and 128 (1B-shaped), bf16, 128 in / 256 out;
# TP=2 with every sum through NCCL for comparison; how long `LLM.close()` takes; and `lorapipe serve
# --tensor-parallel-size 2`'s exit on SIGTERM (seconds and status).
#   usage: bash benchmarks/run_tp_bench.sh OUT_DIR      (PRESETS="1b" for a shorter run)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: run_tp_bench.sh OUT_DIR}")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
py=${PYTHON:-python3}
scratch=${SCRATCH:-${TMPDIR:-/tmp}/lorapipe_scratch}
mkdir -p "$out" "$scratch"
"$py" -m benchmarks.bench_handover --out "$out/handover.json" | tee "$out/handover.txt"
"$py" -m benchmarks.bench_allreduce --out "$out/allreduce.json" | tee "$out/allreduce.txt"
for preset in ${PRESETS:-8b 1b}; do
  model=$scratch/llama-$preset adir=$scratch/adapters-$preset-r16-n4
  if [ ! -f "$model/.complete" ]; then
    rm -rf "$model"
    "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype bfloat16 --seed 0 >/dev/null
    touch "$model/.complete"
  fi
  if [ ! -f "$adir/.complete" ]; then
    rm -rf "$adir"
    "$py" -m tools.make_adapters "$model" "$adir" --n 4 --ranks 16 --targets all --dtype bfloat16 --seed 0 \
      >/dev/null && touch "$adir/.complete"
  fi
  batches="16 64"
  [ "$preset" = 1b ] && batches="64 128"
  i=0
  for tp in 1 2 2 1; do
    i=$((i + 1))
    "$py" -m benchmarks.bench_tp "$model" --tp "$tp" --adapters "$adir"/adapter{0,1,2,3} --batch $batches \
      --rounds 1 --out "$out/${preset}_tp${tp}_$i.json" 2> >(tee -a "$out/bench_tp.log" >&2) \
      | tee -a "$out/bench_tp.txt"
  done
  "$py" -m benchmarks.bench_tp "$model" --tp 2 --adapters "$adir"/adapter{0,1,2,3} --batch $batches \
    --rounds 1 --disable-custom-all-reduce --out "$out/${preset}_tp2_nccl.json" | tee -a "$out/bench_tp.txt"
  "$py" -m benchmarks.compare_greedy "$out/${preset}_tp1_1.json" "$out/${preset}_tp2_2.json" \
    | tee -a "$out/greedy_${preset}.txt"
done
# the server at TP=2 (the last preset): ready, then SIGTERM; its exit status and how long it took
presets=${PRESETS:-8b 1b}
model=$scratch/llama-${presets##* }
"$py" -m runtime.cli serve --model "$model" --tensor-parallel-size 2 --max-lora-rank 16 --port 0 \
  --endpoint tcp://127.0.0.1:29731 --metrics-port 29732 >"$out/serve_tp2.log" 2>&1 &
pid=$!
"$py" -m tools.wait_ready tcp://127.0.0.1:29731 --timeout 600 --pid "$pid"
start=$("$py" -c 'import time; print(time.time())')
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
"$py" -c 'import json, sys, time; print(json.dumps({"serve_tp2_sigterm_s": round(time.time() - float(sys.argv[1]), 2),
  "status": int(sys.argv[2])}))' "$start" "$status" | tee "$out/serve_exit.json"
