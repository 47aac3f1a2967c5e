#!/usr/bin/env bash
# Session 19, call 2 (one H100): issue 14's S1 on this tree (643ec33: the LoRA kernels as programmatic
# dependents, the configs carrying that choice), one fresh server: few, many (cold host cache), many
# (warm), few; then a second server with the 8-adapter requests capped at 190 running requests, the
# number of rank-16 adapters a 4 GB pool holds (3,050 rank rows of 1.41 MB / 16): the throughput the
# 8-adapter requests reach at the batch the 2,000-adapter run can hold.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
R=/tmp/s1; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
PYTHONPATH=/tmp/site:$PWD SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PYTHON=python3 \
  SERVER_FLAGS="$F" PARTS=s1 S1_CAP_RUNNING=190 timeout 580 bash tools/run_churn_bench.sh $R/B > $R/B.txt 2>&1
echo "S1 rc=$? at $((SECONDS - t0)) s"
grep -h "ratio" $R/B.txt
PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_runs $R/B/s1_*.json
for f in $R/B/s1_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
cp $R/B.txt $OUT/
tar -czf $OUT/results.tgz -C $R --exclude='*.jsonl' B
