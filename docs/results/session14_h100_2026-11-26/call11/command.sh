#!/usr/bin/env bash
# Session 14, call 11 (one H100): call 10's four failing test files' tests (CPU tests, collected there
# with tests/stages/worker) on b88ecc0, the tree before this session (.base/b88full, with its tests), and
# on this tree: do they fail on a GPU machine whatever the tree?
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
for T in $PWD/.base/b88full $PWD; do
  echo "== $T"
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:randomly \
    tests/stages/worker/test_overlap_schedule.py tests/stages/worker/test_step_profiler.py 2>&1 | tail -6)
done
