#!/usr/bin/env bash
# Session 18, call 6 (one H100): issue 14's second no-regression pair for a4dbbdb (the LoRA kernels as
# programmatic dependents): the large-adapter overlap scenario (8B-shaped model, 32 rank-64 adapters of
# 335 MB, a GPU adapter pool of 2.7 GiB = 8 of them, distinct adapters, 128 in / 32 out, Poisson 8 req/s),
# B = this tree then A = 14e9c7e (.base/h18): synchronous loading, then overlap + prefetch, a fresh server
# each after the same 128-request warm-up; 120 requests per mode, as in session 17's call 5.
# Before the call: git archive 14e9c7e | tar -x -C .base/h18 --exclude=docs; carry .whl and .base/h18.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/s18c6; mkdir -p $R
t0=$SECONDS
for side in B A; do
  if [ $side = A ]; then T=$PWD/.base/h18 C=14e9c7e; else T=$PWD C=a4dbbdb; fi
  (cd $T && COMMIT=$C PYTHONPATH=/tmp/site:$T SCRATCH=/tmp/scratch8b TRITON_CACHE_DIR=/tmp/tcache PARTS=large NUM_PROMPTS=120 SAT_PROMPTS=0 WARMUP_PROMPTS=128 SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb 2.7" timeout $((585 - SECONDS + t0)) bash tools/run_overlap_bench.sh $R/$side) > $R/$side.txt 2>&1
  echo "$side done at $((SECONDS - t0)) s"; grep -A6 "^| mode\|TTFT P50" $R/$side/results.md 2>/dev/null | head -12
done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch8b s18c6
