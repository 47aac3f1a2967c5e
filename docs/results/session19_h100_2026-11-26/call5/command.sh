#!/usr/bin/env bash
# Session 19, call 5 (one H100): issue 14's S1 on this tree with a larger GPU adapter pool than the
# target's 4 GB (POOL_GB=6, then 8), one fresh server each: few, many (cold host cache), many (warm),
# few. The CPU model (wave_bound/sim.py) says the planner needs about 3,500 rank rows (218 rank-16
# adapters) to serve the 2,000-adapter requests in the 8-adapter run's four rounds of 128 decode steps.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
R=/tmp/s1pool; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
for gb in 6 8; do
  PYTHONPATH=/tmp/site:$PWD SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PYTHON=python3 \
    SERVER_FLAGS="$F" PARTS=s1 POOL_GB=$gb timeout $((585 - SECONDS + t0)) bash tools/run_churn_bench.sh $R/pool$gb > $R/pool$gb.txt 2>&1
  echo "S1 pool $gb GB rc=$? at $((SECONDS - t0)) s"
  grep -h "ratio" $R/pool$gb.txt
  PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_runs $R/pool$gb/s1_*.json
done
for f in $R/*/s1_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
cp $R/*.txt $OUT/
tar -czf $OUT/results.tgz -C $R --exclude='*.jsonl' pool6 pool8
