#!/usr/bin/env bash
# Session 19, call 6 (one H100): the expand covering COLS column blocks a program with one v (its split-K
# partials summed once) and one row gather (working copy, LORAPIPE_EXPAND_COLS=COLS on decode tiles of
# 16 rows and rank tiles up to 64) against A = 6b3d9ef (.base/h19): the eighteenth session's chain_ab.py
# in the order A 2 4 8 8 4 2 A; then the expand's CPU-suite tests on the GPU with cols > 1.
# The working copy was 6b3d9ef with call6/expand_cols.patch applied and call6/test_tmp_cols.py as
# tests/kernels/test_tmp_cols.py.
# Before the call: git archive HEAD | tar -x -C .base/h19 --exclude=docs; carry .whl and .base/h19.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
S=docs/results/session18_h100_2026-11-26/call7/chain_ab.py
for t in A 2 4 8 8 4 2 A; do
  case $t in A) tree=$PWD/.base/h19; cols=1;; *) tree=$PWD; cols=$t;; esac
  echo "== $t at $((SECONDS - t0)) s"
  LORAPIPE_EXPAND_COLS=$cols PYTHONPATH=/tmp/site timeout $((420 - SECONDS + t0)) python3 $S $tree
done 2>&1 | tee $OUT/chain.txt
echo "chains done at $((SECONDS - t0)) s"
(PYTHONPATH=/tmp/site:$PWD timeout $((590 - SECONDS + t0)) python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  tests/kernels/test_tmp_cols.py tests/kernels/test_lora_expand.py 2>&1 | tail -3) | tee $OUT/gpu_tests.txt
echo "done at $((SECONDS - t0)) s"
