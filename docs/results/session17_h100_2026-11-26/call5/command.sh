#!/usr/bin/env bash
# Session 17, call 5 (one H100): issue 14's second no-regression pair, the large-adapter overlap scenario
# (8B-shaped model, 32 rank-64 adapters of 335 MB, a GPU adapter pool of 2.7 GiB = 8 of them, distinct
# adapters, 128 in / 32 out, Poisson 8 req/s), on B = this tree (5b8ca5c: the shrink sums its split-K
# partials for rank tiles above 16, at four programs an SM; the sampler change) then A = 9089d5e: synchronous loading, then overlap + prefetch, a fresh
# server each after the same 128-request warm-up; 120 requests per mode, as in session 14's call 7.
# Before the call: mkdir -p .base/a9089 && git archive 9089d5e | tar -x -C .base/a9089; carry .whl and .base/a9089.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/s17c5; mkdir -p $R
t0=$SECONDS
for side in B A; do
  if [ $side = A ]; then T=$PWD/.base/a9089 C=9089d5e; else T=$PWD C=$(git rev-parse --short HEAD); fi
  (cd $T && COMMIT=$C PYTHONPATH=/tmp/site:$T SCRATCH=/tmp/scratch8b TRITON_CACHE_DIR=/tmp/tcache PARTS=large NUM_PROMPTS=120 SAT_PROMPTS=0 WARMUP_PROMPTS=128 SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb 2.7" timeout $((585 - SECONDS + t0)) bash tools/run_overlap_bench.sh $R/$side) > $R/$side.txt 2>&1
  echo "$side done at $((SECONDS - t0)) s"; grep -A6 "^| mode\|TTFT P50" $R/$side/results.md 2>/dev/null | head -12
done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch8b s17c5
