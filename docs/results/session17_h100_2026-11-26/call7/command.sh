#!/usr/bin/env bash
# Session 17, call 7 (one H100, tree c6b3086 + docs): issue 14's S1 (2,000 rank-16 adapters, uniform, 1,000
# requests 256/128, GPU pool 4 GB, host cache 16 GB, against the same requests over 8 adapters; runs few,
# many (cold host cache), many (warm), few on one server), then again on a second fresh server while the
# time lasts.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
R=/tmp/s17c7; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
for k in 1 2; do
  (SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PYTHON=python3 SERVER_FLAGS="$F" PARTS=s1 \
    timeout $((585 - SECONDS + t0)) bash tools/run_churn_bench.sh $R/s1_$k) > $R/s1_$k.txt 2>&1
  echo "S1 server $k rc=$? at $((SECONDS - t0)) s"
  grep -h "ratio" $R/s1_$k.txt
  python3 -m tools.bench_runs $R/s1_$k/s1_*.json
done
for f in $R/*/s1_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s17c7
