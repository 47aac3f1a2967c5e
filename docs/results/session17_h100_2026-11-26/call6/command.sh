#!/usr/bin/env bash
# Session 17, call 6 (one H100): the shrink's split targets. Session 15's step-timing script over all its
# steps, trees A = c6b3086 (this tree: four programs an SM for rank tiles above 16, one for rank 16),
# B8 = eight for rank tiles above 16 (.base/b8u), R2 = two for rank 16 (.base/b2r), in the order
# A B8 R2 R2 B8 A.
# Before the call: git archive HEAD into .base/b8u and .base/b2r (without docs), then in
# kernels/lora_shrink.py `target = (8 if wide else 1) * sms` and `target = (4 if wide else 2) * sms`;
# carry .whl, .base/b8u, .base/b2r.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
S=docs/results/session15_h100_2026-11-26/steps_ab.py
for t in A B8 R2 R2 B8 A; do
  case $t in A) tree=$PWD;; B8) tree=$PWD/.base/b8u;; R2) tree=$PWD/.base/b2r;; esac
  echo "== $t at $((SECONDS - t0)) s"; TRITON_CACHE_DIR=/tmp/tcache PYTHONPATH=/tmp/site timeout $((580 - SECONDS + t0)) python3 $S $tree all
done 2>&1 | tee $OUT/steps.txt
echo "steps done at $((SECONDS - t0)) s"
