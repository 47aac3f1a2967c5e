#!/usr/bin/env bash
# call 4: writers with 8 parts per load (76331e7) vs parts shared by loads at once (b53e5b6), A-B-B-A;
# GPU tests on b53e5b6; then S1 on b53e5b6
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r4; mkdir -p $R
k=0
for side in A B B A; do
  k=$((k+1)); T=.base/76331e7; [ $side = B ] && T=.base/b53e5b6
  echo "== $side $T" | tee -a $R/loader.txt
  (cd $T && PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_loader --preset 1b --ranks 16,64 --adapter-dtype bfloat16 --reps 7 --writers 8 --out $R/loader_${k}_${side}.json) 2>&1 | tail -2 | tee -a $R/loader.txt
done
T=.base/b53e5b6
(cd $T && PYTHONPATH=/tmp/site:$PWD timeout 170 python3 -m pytest -q -p no:cacheprovider tests/stages/worker/test_overlap_schedule_gpu.py tests/runtime/test_offline_gpu.py tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_layer_waits_gpu.py tests/stages/worker/test_warmup_gpu.py tests/integration/test_overlap_gpu.py tests/stages/loader/test_writers.py) > $R/gpu_tests.txt 2>&1
tail -3 $R/gpu_tests.txt
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0 --no-warmup"
(cd $T && PYTHONPATH=/tmp/site:$PWD SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0.5 SERVER_FLAGS="$F" PARTS=s1 PYTHON=python3 timeout 290 bash tools/run_churn_bench.sh $R/s1) > $R/s1.txt 2>&1
grep -E "^\| s1|ratio|ready" $R/s1.txt | tail -12
tar -czf $OUT/results.tgz -C /tmp r4
