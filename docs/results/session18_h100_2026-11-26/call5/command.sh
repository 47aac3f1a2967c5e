#!/usr/bin/env bash
# Session 18, call 5 (one H100): issue 14's first no-regression pair for a4dbbdb (the LoRA kernels as
# programmatic dependents): the resident 32-adapter burst (1,000 requests 256/128, 32 rank-16 adapters on
# all seven projections), A = 14e9c7e (.base/h18) against B = this tree, A-B-B-A, a fresh server each.
# Before the call: git archive 14e9c7e | tar -x -C .base/h18 --exclude=docs; carry .whl and .base/h18.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
PYTHONPATH=/tmp/site TRITON_CACHE_DIR=/tmp/tcache SCRATCH=/tmp/scratch PYTHON=python3 \
  timeout 580 bash tools/run_ab_serving.sh $OUT/ab $PWD/.base/h18 $PWD > $OUT/ab.txt 2>&1
echo "rc=$? at $((SECONDS - t0)) s"; tail -12 $OUT/ab.txt
rm -rf $OUT/ab/scratch $OUT/ab/*.jsonl
