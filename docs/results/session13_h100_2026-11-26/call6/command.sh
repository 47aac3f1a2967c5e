#!/usr/bin/env bash
# Session 13, call 6 (this tree, decode graphs per LoRA tile class; one H100): issue 14's S1 (2,000 rank-16 adapters, uniform,
# 1,000 requests 256/128, GPU adapter pool 4 GB, host cache 16 GB, against the same requests over 8
# adapters; runs few, many (cold host cache), many (warm), few on one server, warm-up on), last measured in
# session 12 (call 7, 0.734).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/s13c6; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
(SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PYTHON=python3 SERVER_FLAGS="$F" PARTS=s1 timeout 560 bash tools/run_churn_bench.sh $R/s1) > $R/s1.txt 2>&1
echo "S1 rc=$?"
grep -h "ratio\|^| s1\|ready" $R/s1.txt $R/s1/ready.txt
python3 -m tools.bench_runs $R/s1/s1_*.json
for f in $R/s1/s1_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s13c6
