#!/usr/bin/env bash
# session 6, call 1: GPU tests on 400263a (fused pointwise kernels), the pointwise microbenchmark, then
# base-only serving A-B-B-A: f6180a2 (torch pointwise ops) against 400263a
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r1; mkdir -p $R
A=.base/f6180a2 B=.base/400263a
(cd $B && PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache timeout 200 python3 -m pytest -q -p no:cacheprovider -x -rs tests/kernels/test_pointwise.py tests/stages/worker/test_overlap_schedule_gpu.py tests/runtime/test_offline_gpu.py tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_layer_waits_gpu.py tests/stages/worker/test_warmup_gpu.py tests/integration/test_overlap_gpu.py) > $R/gpu_tests.txt 2>&1; tail -4 $R/gpu_tests.txt
(cd $B && PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache timeout 80 python3 -m tools.bench_pointwise --preset 1b --tokens 256,2048,8192 --out $R/pointwise.json) > $R/pointwise.txt 2>&1; cat $R/pointwise.txt
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 BASE_ONLY=1 timeout 270 bash tools/run_ab_serving.sh $R/ab_base $A $B) > $R/ab_base.txt 2>&1
tail -8 $R/ab_base.txt; cat $R/ab_base/ready.txt
tar -czf $OUT/results.tgz -C /tmp --exclude=workload.jsonl --exclude=scratch r1
