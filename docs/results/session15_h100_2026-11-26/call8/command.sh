#!/usr/bin/env bash
# Session 15, call 8 (one H100): the committed rule (rank tiles above 16: split target two programs an SM,
# the shrink sums its partials; rank 16: as before) as B against A = fd2eb4a, A-B-B-A over the steps of
# call 7; then the GPU tests of kernels, backend, graphs, warm-up, overlap and PEFT parity on B.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
D=docs/results/session15_h100_2026-11-26/call8
for t in A B B A; do
  tree=$PWD; [ $t = A ] && tree=$PWD/.base/fd2eb4a
  echo "== $t"; PYTHONPATH=/tmp/site python3 $D/../steps_ab.py $tree all
done 2>&1 | tee $OUT/output.txt
export PYTHONPATH=/tmp/site:$PWD
timeout 300 python3 -m pytest -q -p no:randomly tests/kernels \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_step_graphs_gpu.py \
  tests/stages/worker/test_warmup_gpu.py tests/runtime/test_offline_gpu.py tests/tools/test_bench_lora_step.py \
  tests/stages/worker/test_overlap_schedule_gpu.py tests/stages/worker/test_layer_waits_gpu.py \
  tests/integration/test_overlap_gpu.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
