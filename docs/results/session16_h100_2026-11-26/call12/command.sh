#!/usr/bin/env bash
# Session 16, call 12 (one H100): the GPU tests of the shrink, the backend, decode and step graphs, the
# warm-up, the offline engine against PEFT, the capture helper and bench_lora_step, on call 10's B
# (.base/x4: four programs an SM for rank tiles above 16).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; cd .base/x4 && export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache && timeout 280 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/kernels/test_lora_shrink.py tests/kernels/test_triton_backend.py tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_warmup_gpu.py tests/runtime/test_offline_gpu.py tests/stages/worker/test_graph_capture_gpu.py tests/tools/test_bench_lora_step.py 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
