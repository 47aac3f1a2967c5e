#!/usr/bin/env bash
# Session 18, call 3 (one H100): the kept PDL variant (the shrink a dependent that lets the expand start
# at once; the expands dependents that do not trigger). The GPU tests of the kernels, the graphs and the
# offline engine against PEFT on this tree, the new graph-replay test among them; then that test on a
# mutant (.base/mut: this tree with the expand's two waits before reading v and out removed), which
# must fail.
# Before the call: .base/mut = the working tree's files with those two `if PDL: gdc_wait()` deleted;
# carry .whl and .base/mut.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
(PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  tests/kernels/test_lora_shrink.py tests/kernels/test_lora_expand.py tests/kernels/test_lora_expand_act.py \
  tests/kernels/test_triton_backend.py tests/stages/worker/test_decode_graphs.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/runtime/test_offline_gpu.py \
  tests/stages/worker/test_layer_waits_gpu.py tests/stages/worker/test_warmup_gpu.py 2>&1 | tail -4) | tee $OUT/gpu_tests.txt
echo "tests done at $((SECONDS - t0)) s"
(cd .base/mut && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  "tests/kernels/test_triton_backend.py::test_dependent_launches_in_a_graph_match_torch_every_replay" 2>&1 | tail -15) | tee $OUT/mutant.txt
echo "mutant done at $((SECONDS - t0)) s"
