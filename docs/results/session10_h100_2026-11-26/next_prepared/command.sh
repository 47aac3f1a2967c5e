#!/usr/bin/env bash
# Prepared for the next session, not run: is the large-adapter overlap run's slowdown (session 10 call 5:
# overlap TTFT P50 61.6-63.5 ms against 45.7-47.0 in session 8 call 9, synchronous unchanged) the code or
# the machine? The 'large' part (both modes), bc5b3a4 (session 8's B) against this tree, A-B-B-A on one machine.
# Before the call: mkdir -p .base/bc5b3a4 && git archive bc5b3a4 | tar -x -C .base/bc5b3a4; carry .whl and
# .base/bc5b3a4. run_overlap_bench.sh runs both modes; SYNC_ONLY is not a knob, so each run is the whole
# 'large' part with 60 requests a mode (two servers a run; the 8B model and adapters take about 100 s
# first). If four runs do not fit one 600 s call, run A B in one call and B A in the next on the same machine.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
n=0
for side in A B B A; do
  n=$((n + 1))
  if [ $side = A ]; then T=$PWD/.base/bc5b3a4; else T=$PWD; fi
  (cd $T && PYTHONPATH=/tmp/site:$T SCRATCH=/tmp/scratch8b TRITON_CACHE_DIR=/tmp/tcache PARTS=large NUM_PROMPTS=60 \
    SAT_PROMPTS=0 WARMUP_PROMPTS=64 SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb 2.7" \
    timeout $((585 - SECONDS + t0)) bash tools/run_overlap_bench.sh $OUT/$side$n) > $OUT/$side$n.txt 2>&1
  echo "$side$n rc=$? at $((SECONDS - t0)) s"; grep -A8 "Overlap + prefetch over" $OUT/$side$n/results.md | grep ttft.p50
done
rm -f $OUT/*/*.jsonl
