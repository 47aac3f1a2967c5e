#!/usr/bin/env bash
# Session 16, call 8 (one H100): call 7's one failure (tests/integration/test_pipeline.py, whose report
# the timeout cut off) again, then what call 7 did not reach (test_warmup_gpu.py and tests/tools).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
P="python3 -m pytest -q -p no:randomly -p no:cacheprovider"
timeout 200 $P tests/integration/test_pipeline.py > $OUT/pipeline.txt 2>&1; echo "pipeline rc $?"; tail -1 $OUT/pipeline.txt
timeout 300 $P tests/stages/worker/test_warmup_gpu.py tests/tools --ignore=tests/tools/test_bench_serving.py > $OUT/rest.txt 2>&1
echo "rest rc $?"; grep -E "^(FAILED|ERROR)" $OUT/rest.txt; tail -1 $OUT/rest.txt
