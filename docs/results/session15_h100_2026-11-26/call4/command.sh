#!/usr/bin/env bash
# Session 15, call 4 (one H100): the shrink sums its own split-K partials (B, working tree) against the
# expand summing them (A = fd2eb4a, carried as .base/fd2eb4a), A-B-B-A; B2 = B with the split target at
# two programs an SM. Then the GPU tests of the kernels, backend, graphs, warm-up and PEFT parity on B.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
D=docs/results/session15_h100_2026-11-26/call4
for t in A B B2 B A B2; do
  tree=$PWD; extra=""; [ $t = A ] && tree=$PWD/.base/fd2eb4a; [ $t = B2 ] && extra=2
  echo "== $t"; python3 $D/../steps_ab.py $tree first $extra
done 2>&1 | tee $OUT/output.txt
PYTHONPATH=/tmp/site:$PWD timeout 420 python3 -m pytest -q -p no:randomly tests/kernels \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_step_graphs_gpu.py \
  tests/stages/worker/test_warmup_gpu.py tests/runtime/test_offline_gpu.py tests/tools/test_bench_lora_step.py \
  2>&1 | tail -6 | tee $OUT/gpu_tests.txt
