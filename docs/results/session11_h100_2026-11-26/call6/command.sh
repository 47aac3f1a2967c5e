#!/usr/bin/env bash
# session 11, call 6: the light-load plan depth (2 plans while nothing waits) against the fixed 3 plans.
# The large-adapter overlap scenario (8B-shaped model, 32 rank-64 adapters of 335 MB, a pool of 8,
#    distinct adapters, 128 in / 32 out, Poisson 8 req/s, 60 requests a mode), A-B-B-A on this machine:
#    A = eaca1c1 (.base/eaca1c1, fixed 3 plans), B = this tree. Each run: sync, then overlap.
# Before the call: mkdir -p .base/eaca1c1 && git archive eaca1c1 | tar -x -C .base/eaca1c1; carry .whl and .base/eaca1c1.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
S=/tmp/scratch8b M=/tmp/scratch8b/llama-8b-bfloat16 AD=/tmp/scratch8b/adapters-8b-r64-n32-bfloat16
mkdir -p $S
( python3 -m tools.make_tiny_model $M --preset 8b --dtype bfloat16 --seed 0 && touch $M/.complete ) > $OUT/gen.txt 2>&1 &
gen=$!
until [ -f $M/config.json ] || ! kill -0 $gen 2>/dev/null; do sleep 0.5; done
( python3 -m tools.make_adapters $M $AD --n 32 --ranks 64 --targets all --dtype bfloat16 --seed 0 >/dev/null \
  && touch $AD/.complete ) >> $OUT/gen.txt 2>&1 &
adp=$!
wait $gen $adp; echo "generated at $((SECONDS - t0)) s"
n=0
for side in A B B A; do
  n=$((n + 1))
  if [ $side = A ]; then T=$PWD/.base/eaca1c1; else T=$PWD; fi
  (cd $T && PYTHONPATH=/tmp/site:$T SCRATCH=$S TRITON_CACHE_DIR=/tmp/tcache PARTS=large NUM_PROMPTS=60 \
    SAT_PROMPTS=0 WARMUP_PROMPTS=64 COMMIT=$side SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb 2.7" \
    timeout $((585 - SECONDS + t0)) bash tools/run_overlap_bench.sh $OUT/$side$n) > $OUT/$side$n.txt 2>&1
  echo "$side$n rc=$? at $((SECONDS - t0)) s"
  grep -E "^\| (ttft.p50|ttft.p95|e2e.p50) " $OUT/$side$n/results.md
  grep -E "^(ITL|TPOT) " $OUT/$side$n.txt | tr -s ' '
done
rm -f $OUT/*/*.jsonl
