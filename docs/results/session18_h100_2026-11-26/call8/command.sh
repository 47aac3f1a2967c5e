#!/usr/bin/env bash
# Session 18, call 8 (one H100): Z = this working copy (launches over more than 512 tiles keep plain
# stream order, `device_info.PDL_MAX_TILES`) against X = a4dbbdb (.base/a4d, every launch a dependent):
# call 7's chain_ab.py in the order X Z Z X; then the backend's GPU tests on Z.
# Before the call: git archive a4dbbdb | tar -x -C .base/a4d --exclude=docs; carry .whl and .base/a4d.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
S=docs/results/session18_h100_2026-11-26/call7/chain_ab.py
for t in X Z Z X; do
  case $t in X) tree=$PWD/.base/a4d;; Z) tree=$PWD;; esac
  echo "== $t at $((SECONDS - t0)) s"
  PYTHONPATH=/tmp/site timeout $((400 - SECONDS + t0)) python3 $S $tree
done 2>&1 | tee $OUT/chain.txt
echo "chains done at $((SECONDS - t0)) s"
(PYTHONPATH=/tmp/site:$PWD timeout $((590 - SECONDS + t0)) python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  tests/kernels/test_triton_backend.py tests/stages/worker/test_step_graphs_gpu.py 2>&1 | tail -3) | tee $OUT/gpu_tests.txt
echo "done at $((SECONDS - t0)) s"
