#!/usr/bin/env bash
# Prepared, not run (session 18 had no device time left): issue 14's S1 with the LoRA kernels as
# programmatic dependents (B = this tree) against A = 14e9c7e (.base/h18), one fresh server each, A then
# B; each server runs few, many (cold host cache), many (warm), few. The GEMM chains of calls 7 and 8 put
# the S1-like decode step's LoRA kernels and GEMMs 2.4 % faster; one server's S1 ratio has spread
# 0.68-0.75 before (seventeenth session), so a second call in the order B then A is needed to read it.
# Before the call: git archive 14e9c7e | tar -x -C .base/h18 --exclude=docs; carry .whl and .base/h18.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
R=/tmp/s1ab; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
for side in A B; do
  if [ $side = A ]; then T=$PWD/.base/h18; else T=$PWD; fi
  (cd $T && PYTHONPATH=/tmp/site:$T SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PYTHON=python3 \
    SERVER_FLAGS="$F" PARTS=s1 timeout $((585 - SECONDS + t0)) bash tools/run_churn_bench.sh $R/$side) > $R/$side.txt 2>&1
  echo "S1 $side rc=$? at $((SECONDS - t0)) s"
  grep -h "ratio" $R/$side.txt
  PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_runs $R/$side/s1_*.json
done
for f in $R/*/s1_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s1ab
