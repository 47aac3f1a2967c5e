#!/usr/bin/env bash
# Session 19, call 7 (one H100): issue 14's S2 on this tree (c31dc49; its runtime code is 643ec33's), two
# fresh servers: the mix then base-only on the first, base-only then the mix on the second.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
n=0
for passes in "mix base" "base mix"; do
  n=$((n + 1))
  PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 \
    PYTHON=python3 SERVER_FLAGS="$F" S2_PASSES="$passes" S2_RATE_RUN=0 \
    timeout $((590 - SECONDS + t0)) bash tools/run_churn_bench.sh $OUT/S$n > $OUT/S$n.txt 2>&1
  echo "S$n rc=$? at $((SECONDS - t0)) s"
  PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_runs $OUT/S$n/s2_*.json 2>/dev/null
  grep -h "ratio" $OUT/S$n.txt
done
for f in $OUT/*/s2_*.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -f $OUT/*/*.jsonl; tar -czf $OUT/results.tgz -C $OUT S1 S2 2>/dev/null; rm -rf $OUT/S1 $OUT/S2
