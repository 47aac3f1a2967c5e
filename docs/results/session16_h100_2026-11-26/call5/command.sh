#!/usr/bin/env bash
# Session 16, call 5 (one H100): the whole test suite on this tree, except the files that need
# packages the GPU machine lacks (openai, ray; CI runs them), one line per test.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
timeout 570 python3 -m pytest -v -p no:randomly -p no:cacheprovider tests --ignore=tests/integration/test_http.py \
  --ignore=tests/integration/test_ray_serve.py --ignore=tests/tools/test_bench_serving.py --ignore=tests/runtime/ray_serve > $OUT/all.txt 2>&1
echo "rc $?"
grep -E "(FAILED|ERROR)" $OUT/all.txt | grep -v "^E " | head -30; tail -2 $OUT/all.txt
