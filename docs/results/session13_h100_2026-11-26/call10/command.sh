#!/usr/bin/env bash
# Session 13, call 10 (one H100): every GPU test file of call 1 on 90364ea (the base backend's tile class 1).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
timeout 560 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/kernels \
  tests/integration/test_overlap_gpu.py tests/runtime/common/test_host_pool.py tests/runtime/test_offline_gpu.py \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_layer_waits_gpu.py \
  tests/stages/worker/test_lora_pool.py tests/stages/worker/test_overlap_schedule_gpu.py \
  tests/stages/worker/test_step_graphs.py tests/stages/worker/test_step_graphs_gpu.py \
  tests/stages/worker/test_warmup.py tests/stages/worker/test_warmup_gpu.py tests/stages/worker/test_warmup_plan.py \
  tests/tools/test_bench_lora_step.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
