#!/usr/bin/env bash
# Session 16, call 10 (one H100): the shrink's split aimed at four programs an SM for rank tiles above 16
# (B: .base/x4 = 05b1852 with `target = (4 if wide else 1) * sms` in kernels/lora_shrink.py) against two
# (A: this tree, 05b1852): session 15's step-timing script over its first set of steps, A-B-B-A; then
# issue 14's S2 mix, B then A, a fresh server each (the time left allows two).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
S=docs/results/session15_h100_2026-11-26/steps_ab.py
for t in A B B A; do
  tree=$PWD; [ $t = B ] && tree=$PWD/.base/x4
  echo "== $t"; TRITON_CACHE_DIR=/tmp/tcache PYTHONPATH=/tmp/site python3 $S $tree first
done 2>&1 | tee $OUT/steps.txt
echo "steps done at $((SECONDS - t0)) s"
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
for side in B A; do
  if [ $side = B ]; then T=$PWD/.base/x4; else T=$PWD; fi
  (cd $T && PYTHONPATH=/tmp/site:$T TRITON_CACHE_DIR=/tmp/tcache SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 \
    PYTHON=python3 SERVER_FLAGS="$F" S2_PASSES="mix" S2_RATE_RUN=0 \
    timeout $((590 - SECONDS + t0)) bash tools/run_churn_bench.sh $OUT/$side) > $OUT/$side.txt 2>&1
  echo "$side rc=$? at $((SECONDS - t0)) s"
  PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_runs $OUT/$side/s2_*.json 2>/dev/null
done
rm -rf $OUT/A $OUT/B
