#!/usr/bin/env bash
# Session 16, call 9 (one H100): tests/integration/test_pipeline.py six times in a row, each in a fresh
# process, to catch call 7's one failure with its report (first failing run's output kept).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
for i in 1 2 3 4 5 6; do
  timeout 120 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/integration/test_pipeline.py > /tmp/p$i.txt 2>&1
  rc=$?; echo "run $i rc $rc: $(tail -1 /tmp/p$i.txt)"
  if [ $rc != 0 ]; then cp /tmp/p$i.txt $OUT/failed_run$i.txt; fi
done
