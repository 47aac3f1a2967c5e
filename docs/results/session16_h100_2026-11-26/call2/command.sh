#!/usr/bin/env bash
# Session 16, call 2 (one H100), each on an empty Triton cache:
# 1. the new start-up capture test against 21d4886 (.base/head, before graph_capture.recording): must fail;
# 2. the new GPU and CPU tests on 9089d5e (this tree): must pass;
# 3. 9089d5e + shrink_reduce.patch (.base/reduce): session 15's call-8 GPU test list.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
T=tests/stages/worker/test_graph_capture_gpu.py
(cd .base/head && export TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site:$PWD &&
  timeout 150 python3 -m pytest -q -p no:randomly $T -k start_up > $OUT/head_new_test.txt 2>&1; echo "1 head rc $?")
tail -3 $OUT/head_new_test.txt
(export TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site:$PWD &&
  timeout 150 python3 -m pytest -q -p no:randomly $T tests/stages/worker/test_graph_capture.py > $OUT/fix_new_tests.txt 2>&1
  echo "2 fix rc $?")
tail -3 $OUT/fix_new_tests.txt
(cd .base/reduce && export TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site:$PWD &&
  timeout 420 python3 -m pytest -q -p no:randomly tests/kernels tests/stages/worker/test_decode_graphs.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_warmup_gpu.py tests/runtime/test_offline_gpu.py \
  tests/tools/test_bench_lora_step.py tests/stages/worker/test_overlap_schedule_gpu.py \
  tests/stages/worker/test_layer_waits_gpu.py tests/integration/test_overlap_gpu.py $T > $OUT/reduce_gpu_tests.txt 2>&1
  echo "3 reduce rc $?")
grep -E "^(FAILED|ERROR)" $OUT/reduce_gpu_tests.txt | head; tail -2 $OUT/reduce_gpu_tests.txt
