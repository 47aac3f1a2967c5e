#!/usr/bin/env bash
# session 10, call 6: the GPU tests of step and decode graphs and of the warm-up on the session's last tree
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/stages/worker/test_step_graphs_gpu.py \
  tests/runtime/test_offline_gpu.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -4 $OUT/gpu_tests.txt
