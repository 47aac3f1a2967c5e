#!/usr/bin/env bash
# Session 16, call 11 (one H100): call 10's A (05b1852, two programs an SM for rank tiles above 16) and B
# (.base/x4, four) over the step-timing script's second set of steps, A-B-B-A.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
S=docs/results/session15_h100_2026-11-26/steps_ab.py
for t in A B B A; do
  tree=$PWD; [ $t = B ] && tree=$PWD/.base/x4
  echo "== $t"; TRITON_CACHE_DIR=/tmp/tcache PYTHONPATH=/tmp/site python3 $S $tree more
done 2>&1 | tee $OUT/steps.txt
