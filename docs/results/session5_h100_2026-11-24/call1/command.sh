#!/usr/bin/env bash
# call 1: loader A-B-B-A (48e93b5 vs 0422f01), then S2 on 0422f01 with a 0.5 s metrics timeline
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r1; mkdir -p $R
nproc > $R/nproc.txt
for side in A B B A; do
  T=.base/48e93b5; [ $side = B ] && T=.base/0422f01
  (cd $T && PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_loader --preset 1b --ranks 16,64 --adapter-dtype bfloat16 --reps 7 --out $R/loader_${side}_$RANDOM.json) 2>&1 | tail -4 | tee -a $R/loader.txt
done
for side in A B; do
  T=.base/48e93b5; [ $side = B ] && T=.base/0422f01
  (cd $T && PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_loader --preset 1b --ranks 16 --adapter-dtype float32 --reps 7 --out $R/loader_f32_${side}.json) 2>&1 | tail -3 | tee -a $R/loader.txt
done
T=.base/0422f01
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0 --no-warmup"
(cd $T && PYTHONPATH=/tmp/site:$PWD SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0.5 S2_PASSES="base mix" S2_RATE_RUN=0 SERVER_FLAGS="$F" PARTS=s2 PYTHON=python3 timeout 360 bash tools/run_churn_bench.sh $R/s2) > $R/s2.txt 2>&1
tail -40 $R/s2.txt
tar -czf $OUT/results.tgz -C /tmp r1
