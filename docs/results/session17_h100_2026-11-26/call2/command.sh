#!/usr/bin/env bash
# Session 17, call 2 (one H100): the reducing shrink with splits in proportion to each tile's real rank.
# Session 15's step-timing script over all its steps, trees A = 8efb6c0 (.base/a8ef), B4 = this working
# tree (proportional splits, the split target of four programs an SM), B8 = the same with eight
# (.base/b8), in the order A B4 B8 B8 B4 A; then the sampler's finiteness check, before and after.
# Before the call: git archive 8efb6c0 | tar -x -C .base/a8ef --exclude=docs; .base/b8 = the working tree
# with `target = (8 if wide else 1) * sms`; carry .whl, .base/a8ef, .base/b8.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
S=docs/results/session15_h100_2026-11-26/steps_ab.py
for t in A B4 B8 B8 B4 A; do
  case $t in A) tree=$PWD/.base/a8ef;; B4) tree=$PWD;; B8) tree=$PWD/.base/b8;; esac
  echo "== $t at $((SECONDS - t0)) s"; TRITON_CACHE_DIR=/tmp/tcache PYTHONPATH=/tmp/site timeout $((560 - SECONDS + t0)) python3 $S $tree all
done 2>&1 | tee $OUT/steps.txt
echo "steps done at $((SECONDS - t0)) s"
python3 docs/results/session17_h100_2026-11-26/call2/sampler_check.py 2>&1 | tee $OUT/sampler.txt
