#!/usr/bin/env bash
# call 5: S2 on b53e5b6 with the warm-up on (the default: every kernel variant compiled before ready);
# then resident 32 adapters A-B-B-A, 48e93b5 (before the writers) against b53e5b6
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r5; mkdir -p $R
T=.base/b53e5b6
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
(cd $T && PYTHONPATH=/tmp/site:$PWD SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0.5 SERVER_FLAGS="$F" PARTS=s2 PYTHON=python3 timeout 340 bash tools/run_churn_bench.sh $R/s2) > $R/s2.txt 2>&1
grep -E "^\| s2|ratio|ready" $R/s2.txt | tail -12
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 timeout 230 bash tools/run_ab_serving.sh $R/ab .base/48e93b5 .base/b53e5b6) > $R/ab.txt 2>&1
tail -8 $R/ab.txt; cat $R/ab/ready.txt 2>/dev/null
tar -czf $OUT/results.tgz -C /tmp r5
