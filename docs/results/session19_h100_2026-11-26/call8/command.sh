#!/usr/bin/env bash
# Session 19, call 8 (one H100): one persistent launch per group for the LoRA shrink and expand, each
# tile's expand waiting only for that tile's shrink (a measurement script), against today's two launches
# with programmatic dependent launch; one process with one program an SM, then one with two.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
S=docs/results/session19_h100_2026-11-26/call8/fused_pair.py
t0=$SECONDS
for k in 1 2; do
  echo "== $k program(s) an SM at $((SECONDS - t0)) s"
  timeout $((280 - SECONDS + t0)) python3 $S $k
  echo "rc=$?"
done 2>&1 | tee $OUT/output.txt
