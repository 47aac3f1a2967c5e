#!/usr/bin/env bash
# session 10, call 5: issue 14's other no-regression pair, the large-adapter overlap scenario (8B-shaped
# model, 32 rank-64 adapters of 335 MB, a pool of 8, distinct adapters, 128 in / 32 out, Poisson 8 req/s;
# 120 requests a mode as in session 8 call 9), one tree: B = the default (--adapter-affinity-steps 200),
# then A = --adapter-affinity-steps 0 (queue order, as before); synchronous loading, then overlap.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
for side in B A; do
  extra=""; [ $side = A ] && extra="--adapter-affinity-steps 0"
  SCRATCH=/tmp/scratch8b TRITON_CACHE_DIR=/tmp/tcache PARTS=large NUM_PROMPTS=120 SAT_PROMPTS=0 WARMUP_PROMPTS=128 \
    SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb 2.7 $extra" timeout $((585 - SECONDS + t0)) \
    bash tools/run_overlap_bench.sh $OUT/$side > $OUT/$side.txt 2>&1
  echo "$side rc=$? at $((SECONDS - t0)) s"; grep -B2 -A12 "Overlap + prefetch over" $OUT/$side/results.md 2>/dev/null | head -30
done
rm -f $OUT/*/*.jsonl
