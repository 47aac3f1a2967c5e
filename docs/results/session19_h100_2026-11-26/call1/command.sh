#!/usr/bin/env bash
# Session 19, call 1: bb6521e and 0d1e7ef (the kernel configs carry the dependent-launch choice) ran on the CPU only.

set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export TRITON_CACHE_DIR=/tmp/tcache PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
timeout 500 python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  tests/kernels/test_triton_backend.py tests/kernels/test_lora_expand_act.py tests/stages/worker/test_decode_graphs.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_warmup_gpu.py tests/runtime/test_offline_gpu.py \
  tests/stages/worker/test_layer_waits_gpu.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
echo "done at $((SECONDS - t0)) s"
