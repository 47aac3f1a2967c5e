#!/usr/bin/env bash
# Prepared for the next session (not run): c9af04b's device-time saving, which call 8's serving A/B could
# not resolve. Issue 14's S2 mix on A = c6b3086 (.base/c6b) and B = this tree, one fresh server each,
# with the worker's step profiler over plans 373-822 as in call 1; then tools.gpu_timeline on each trace.
# Expected: B's trace has no `vectorized_gather_kernel` over the logits (0.041 s in call 1's window) and
# its busy time a plan is lower by about that much. The profiler slows the runs: compare device time,
# not throughput.
# Before the call: mkdir -p .base/c6b && git archive c6b3086 | tar -x -C .base/c6b --exclude=docs;
# carry .whl and .base/c6b.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/next; mkdir -p $R
t0=$SECONDS
for side in A B; do
  if [ $side = A ]; then T=$PWD/.base/c6b; else T=$PWD; fi
  F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0 --profile-dir $R/$side/p --profile-steps 350:450"
  (cd $T && PYTHONPATH=/tmp/site:$T TRITON_CACHE_DIR=/tmp/tcache SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 \
    PYTHON=python3 SERVER_FLAGS="$F" S2_PASSES=mix S2_RATE_RUN=0 timeout $((585 - SECONDS + t0)) \
    bash tools/run_churn_bench.sh $R/$side) > $R/$side.txt 2>&1
  echo "$side rc=$? at $((SECONDS - t0)) s"
  grep -h "step profile" $R/$side/server_s2.log | cut -c1-600
  for t in $R/$side/p/*.json.gz; do PYTHONPATH=/tmp/site:$PWD python3 -m tools.gpu_timeline $t --top 40 > $R/$side/timeline.txt; done
  grep -h "gather\|busy" $R/$side/timeline.txt
  rm -rf $R/$side/p
done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch next
