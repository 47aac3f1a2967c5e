#!/usr/bin/env bash
# Session 15, call 3 (one H100): the shrink's split target at two programs an SM (B, the working tree)
# against one (A = fd2eb4a, carried as .base/fd2eb4a), A-B-B-A, then the kernels' GPU tests on B.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
D=docs/results/session15_h100_2026-11-26/call3
for t in A B B A; do
  tree=$PWD; [ $t = A ] && tree=$PWD/.base/fd2eb4a
  echo "== $t"; python3 $D/../steps_ab.py $tree first
done 2>&1 | tee $OUT/output.txt
PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:randomly tests/kernels 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
