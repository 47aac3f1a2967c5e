#!/usr/bin/env bash
# session 6, call 5: S2 (issue 14: 1,000 adapters of ranks 8-64, Zipf 1.0, input 32:1024, output 16:256,
# GPU adapter pool 4 GB, host cache 8 GB) on 7c8e9bd, warm-up on, as the fifth session's call 5
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r5; mkdir -p $R
T=.base/7c8e9bd
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
(cd $T && PYTHONPATH=/tmp/site:$PWD SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0.5 SERVER_FLAGS="$F" PARTS=s2 PYTHON=python3 timeout 400 bash tools/run_churn_bench.sh $R/s2) > $R/s2.txt 2>&1
grep -E "^\| s2|ratio|ready" $R/s2.txt | tail -12
tar -czf $OUT/results.tgz -C /tmp r5
