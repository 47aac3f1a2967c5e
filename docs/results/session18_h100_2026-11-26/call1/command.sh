#!/usr/bin/env bash
# Session 18, call 1 (one H100): the LoRA kernels launched as programmatic dependents (PDL). Trees:
# A = 14e9c7e (.base/h18, the seventeenth session's last), B = this working tree (PDL on), C = this tree
# with LORAPIPE_PDL=0 (same code, plain stream order). First the GPU tests of the kernels, the graphs and
# the offline engine against PEFT on B; then session 15's step-timing script (a step's LoRA kernels, one
# graph) in the order A B C C B A; then whole decode and mixed steps of the model runner (profile_step,
# base GEMMs between the LoRA kernels) in the order C B B C.
# Before the call: git archive 14e9c7e | tar -x -C .base/h18 --exclude=docs; carry .whl and .base/h18.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
(PYTHONPATH=/tmp/site:$PWD timeout 220 python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  tests/kernels/test_lora_shrink.py tests/kernels/test_lora_expand.py tests/kernels/test_lora_expand_act.py \
  tests/kernels/test_triton_backend.py tests/stages/worker/test_decode_graphs.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/runtime/test_offline_gpu.py 2>&1 | tail -4) | tee $OUT/gpu_tests.txt
echo "tests done at $((SECONDS - t0)) s"
S=docs/results/session15_h100_2026-11-26/steps_ab.py
for t in A B C C B A; do
  case $t in A) tree=$PWD/.base/h18; pdl=1;; B) tree=$PWD; pdl=1;; C) tree=$PWD; pdl=0;; esac
  echo "== $t at $((SECONDS - t0)) s"
  LORAPIPE_PDL=$pdl PYTHONPATH=/tmp/site timeout $((420 - SECONDS + t0)) python3 $S $tree all
done 2>&1 | tee $OUT/steps.txt
echo "steps done at $((SECONDS - t0)) s"
export PYTHONPATH=/tmp/site:$PWD
M=/tmp/m1b AD=/tmp/mix
python3 -m tools.make_tiny_model $M --preset 1b --dtype bfloat16 --seed 0 > /dev/null 2>&1
python3 -m tools.make_adapters $M $AD --n 64 --ranks 8,16,32,64 --targets all --dtype bfloat16 --seed 2 > /dev/null 2>&1
echo "model and adapters at $((SECONDS - t0)) s"
for t in C B B C; do
  case $t in B) pdl=1;; C) pdl=0;; esac
  for shape in "--batch 256" "--batch 190 --mix-prefill 768"; do
    [ $((SECONDS - t0)) -lt 540 ] || break 2
    echo "== $t $shape"
    LORAPIPE_PDL=$pdl timeout 60 python3 tools/profile_step.py --model $M --adapter-dir $AD --ctx 256 --steps 30 \
      --slots 62 --max-lora-rank 64 --lora-gpu-memory-gb 4 $shape 2>&1 | grep -E "graph"
  done
done 2>&1 | tee $OUT/profile.txt
echo "done at $((SECONDS - t0)) s"
