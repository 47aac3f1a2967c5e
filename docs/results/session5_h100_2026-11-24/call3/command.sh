#!/usr/bin/env bash
# call 3: loader A-B-B-A (48e93b5 threads vs 76331e7 with 8 writer processes), then S2 on 76331e7
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r3; mkdir -p $R
k=0
for side in A B B A; do
  k=$((k+1))
  T=.base/48e93b5; X=""; [ $side = B ] && T=.base/76331e7 && X="--writers 8"
  echo "== $side $T $X" | tee -a $R/loader.txt
  (cd $T && PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_loader --preset 1b --ranks 16,64 --adapter-dtype bfloat16 --reps 7 $X --out $R/loader_${k}_${side}.json) 2>&1 | tail -3 | tee -a $R/loader.txt
done
(cd .base/76331e7 && PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_loader --preset 1b --ranks 16,64 --adapter-dtype float32 --reps 7 --writers 8 --out $R/loader_f32_B.json) 2>&1 | tail -3 | tee -a $R/loader.txt
T=.base/76331e7
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0 --no-warmup"
(cd $T && PYTHONPATH=/tmp/site:$PWD SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0.5 SERVER_FLAGS="$F" PARTS=s2 PYTHON=python3 timeout 400 bash tools/run_churn_bench.sh $R/s2) > $R/s2.txt 2>&1
grep -E "^\| s2|ratio|wait" $R/s2.txt | tail -12
tar -czf $OUT/results.tgz -C /tmp r3
