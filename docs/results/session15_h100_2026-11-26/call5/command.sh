#!/usr/bin/env bash
# Session 15, call 5 (one H100): the kept heuristic (the shrink sums its partials; split target two
# programs an SM, the narrow-block rule still at one) as B against A = fd2eb4a, A-B-B-A; then the GPU
# tests of the kernels, backend, graphs, warm-up and PEFT parity on B.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
D=docs/results/session15_h100_2026-11-26/call5
for t in A B B A; do
  tree=$PWD; [ $t = A ] && tree=$PWD/.base/fd2eb4a
  echo "== $t"; python3 $D/../steps_ab.py $tree first
done 2>&1 | tee $OUT/output.txt
PYTHONPATH=/tmp/site:$PWD timeout 420 python3 -m pytest -q -p no:randomly tests/kernels \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_step_graphs_gpu.py \
  tests/stages/worker/test_warmup_gpu.py tests/runtime/test_offline_gpu.py tests/tools/test_bench_lora_step.py \
  tests/stages/worker/test_overlap_schedule_gpu.py tests/stages/worker/test_layer_waits_gpu.py \
  2>&1 | tail -6 | tee $OUT/gpu_tests.txt
