#!/usr/bin/env bash
# Session 18, call 9 (one H100): B = bb127f5 (this tree: PDL for launches of at most 512 tiles)
# against A = 14e9c7e (.base/h18): issue 14's S2, A-B-B-A, a fresh server each, the mix on every server
# and base-only on the first and last (as session 17's call 8).
# Before the call: git archive 14e9c7e | tar -x -C .base/h18 --exclude=docs; carry .whl and .base/h18.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
n=0
for side in A B B A; do
  n=$((n + 1))
  if [ $side = A ]; then T=$PWD/.base/h18; else T=$PWD; fi
  if [ $n = 1 ] || [ $n = 4 ]; then passes="mix base"; else passes="mix"; fi
  (cd $T && PYTHONPATH=/tmp/site:$T TRITON_CACHE_DIR=/tmp/tcache SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 \
    PYTHON=python3 SERVER_FLAGS="$F" S2_PASSES="$passes" S2_RATE_RUN=0 \
    timeout $((590 - SECONDS + t0)) bash tools/run_churn_bench.sh $OUT/$side$n) > $OUT/$side$n.txt 2>&1
  echo "$side$n rc=$? at $((SECONDS - t0)) s"
  (cd $PWD && PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_runs $OUT/$side$n/s2_*.json 2>/dev/null)
done
for f in $OUT/*/s2_*.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -f $OUT/*/*.jsonl; tar -czf $OUT/results.tgz -C $OUT A1 B2 B3 A4 2>/dev/null; rm -rf $OUT/A1 $OUT/B2 $OUT/B3 $OUT/A4
