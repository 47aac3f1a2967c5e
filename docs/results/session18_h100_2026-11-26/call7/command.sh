#!/usr/bin/env bash
# Session 18, call 7 (one H100): the expand's single-step path (B rows loaded before the PDL wait) also
# where the shrink leaves split-K partials (rank-16 tiles): Y = this working copy against X = a4dbbdb
# (.base/a4d) and A = 14e9c7e (.base/h18, no PDL), chain_ab.py (LoRA kernels alone, and after each group's
# GEMM) in the order A X Y Y X A; then the GPU kernel and graph tests on Y.
# Before the call: git archive a4dbbdb | tar -x -C .base/a4d --exclude=docs (and 14e9c7e into .base/h18);
# carry .whl, .base/a4d and .base/h18.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
S=docs/results/session18_h100_2026-11-26/call7/chain_ab.py
for t in A X Y Y X A; do
  case $t in A) tree=$PWD/.base/h18;; X) tree=$PWD/.base/a4d;; Y) tree=$PWD;; esac
  echo "== $t at $((SECONDS - t0)) s"
  PYTHONPATH=/tmp/site timeout $((420 - SECONDS + t0)) python3 $S $tree
done 2>&1 | tee $OUT/chain.txt
echo "chains done at $((SECONDS - t0)) s"
(PYTHONPATH=/tmp/site:$PWD timeout $((590 - SECONDS + t0)) python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  tests/kernels/test_lora_expand.py tests/kernels/test_lora_expand_act.py tests/kernels/test_triton_backend.py \
  tests/stages/worker/test_decode_graphs.py tests/runtime/test_offline_gpu.py 2>&1 | tail -3) | tee $OUT/gpu_tests.txt
echo "done at $((SECONDS - t0)) s"
