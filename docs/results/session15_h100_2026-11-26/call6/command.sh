#!/usr/bin/env bash
# Session 15, call 6 (one H100): other decode steps with the kept heuristic (the shrink sums its partials; split target two
# programs an SM, the narrow-block rule still at one) as B against A = fd2eb4a, A-B-B-A; then the backend's GPU
# tests (its tile-class test changed after call 5).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
D=docs/results/session15_h100_2026-11-26/call6
for t in A B B A; do
  tree=$PWD; [ $t = A ] && tree=$PWD/.base/fd2eb4a
  echo "== $t"; python3 $D/../steps_ab.py $tree more
done 2>&1 | tee $OUT/output.txt
PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:randomly tests/kernels/test_triton_backend.py 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
