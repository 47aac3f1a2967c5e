#!/usr/bin/env bash
# session 6, call 6: S2 on 7c8e9bd as in call 5, with the worker's step profiler over plans 1300-1499 (inside the
# first saturating mix run, which ran plans 1003-1816 in call 5): GPU-busy share and device time by kernel
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r6; mkdir -p $R
T=.base/7c8e9bd
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0 --profile-dir $R/p --profile-steps 1300:200"
(cd $T && PYTHONPATH=/tmp/site:$PWD SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0.5 SERVER_FLAGS="$F" PARTS=s2 PYTHON=python3 timeout 400 bash tools/run_churn_bench.sh $R/s2) > $R/s2.txt 2>&1
grep -E "^\| s2|ratio|ready" $R/s2.txt | tail -12
grep -h "step profile" $R/s2/server_s2.log | grep wall | cut -c1-400
for t in $R/p/*.json.gz; do PYTHONPATH=/tmp/site:$T python3 -m tools.gpu_timeline $t --top 30 > $R/timeline.txt; done
head -75 $R/timeline.txt
rm -rf $R/p
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' r6
