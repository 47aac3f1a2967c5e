#!/usr/bin/env bash
# Session 17, call 4 (one H100): issue 14's S2 (1,000 adapters of ranks 8/16/32/64, Zipf 1.0, 32:1024 in,
# 16:256 out, GPU pool 4 GB, host cache 8 GB; 1B shape) with A = 8efb6c0 (.base/a8ef) against B = 5b8ca5c
# (this tree: the sampler's finiteness check from each row's max and min; the collector pause timer),
# A-B-B-A, a fresh server each: the mix, and on every server base-only too.
# Before the call: mkdir -p .base/a8ef && git archive 8efb6c0 | tar -x -C .base/a8ef --exclude=docs;
# carry .whl and .base/a8ef.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
n=0
for side in A B B A; do
  n=$((n + 1))
  if [ $side = A ]; then T=$PWD/.base/a8ef; else T=$PWD; fi
  (cd $T && PYTHONPATH=/tmp/site:$T TRITON_CACHE_DIR=/tmp/tcache SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 \
    PYTHON=python3 SERVER_FLAGS="$F" S2_PASSES="mix base" S2_RATE_RUN=0 \
    timeout $((595 - SECONDS + t0)) bash tools/run_churn_bench.sh $OUT/$side$n) > $OUT/$side$n.txt 2>&1
  echo "$side$n rc=$? at $((SECONDS - t0)) s"
  (cd $PWD && PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_runs $OUT/$side$n/s2_*.json 2>/dev/null)
done
for f in $OUT/*/s2_*.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -f $OUT/*/*.jsonl; tar -czf $OUT/results.tgz -C $OUT A1 B2 B3 A4 2>/dev/null; rm -rf $OUT/A1 $OUT/B2 $OUT/B3 $OUT/A4
