#!/usr/bin/env bash
# session 12, call 10 (the warm H100 of calls 8-9, model and Triton cache kept): the idle-server pair of call 4 on an H100
# no longer queue behind adapter copies in the copy engine. (1) The GPU test files, the new
# tests/kernels/test_host_copy.py included, while the 8B model is generated on other cores; (2) the
# large-adapter overlap scenario, A = 5785a16 (.base/5785a16) against B = this tree, at 1 req/s (30
# requests a mode) and at 8 req/s (60 a mode), in the order B A A B.
# Before the call: mkdir -p .base/5785a16 && git archive 5785a16 | tar -x -C .base/5785a16; carry .whl and .base/5785a16.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
S=/tmp/scratch8b M=/tmp/scratch8b/llama-8b-bfloat16 AD=/tmp/scratch8b/adapters-8b-r64-n32-bfloat16
mkdir -p $S
if [ ! -f $AD/.complete ]; then
  ( taskset -c 8-15 python3 -m tools.make_tiny_model $M --preset 8b --dtype bfloat16 --seed 0 && touch $M/.complete ) > $OUT/gen.txt 2>&1 &
  gen=$!
  until [ -f $M/config.json ] || ! kill -0 $gen 2>/dev/null; do sleep 0.5; done
  ( taskset -c 8-15 python3 -m tools.make_adapters $M $AD --n 32 --ranks 64 --targets all --dtype bfloat16 --seed 0 >/dev/null \
    && touch $AD/.complete ) >> $OUT/gen.txt 2>&1 &
  adp=$!
fi
wait; echo "generated at $((SECONDS - t0)) s"
for run in B1 A1 A1b B1b; do
  side=${run:0:1} r=${run:1:1}
  if [ $side = A ]; then T=$PWD/.base/5785a16; else T=$PWD; fi
  if [ $r = 1 ]; then n=20; else n=60; fi
  (cd $T && PYTHONPATH=/tmp/site:$T SCRATCH=$S TRITON_CACHE_DIR=/tmp/tcache PARTS=large RATE=$r NUM_PROMPTS=$n \
    SAT_PROMPTS=0 WARMUP_PROMPTS=64 COMMIT=$side SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb 2.7" \
    timeout $((590 - SECONDS + t0)) bash tools/run_overlap_bench.sh $OUT/$run) > $OUT/$run.txt 2>&1
  echo "$run rc=$? at $((SECONDS - t0)) s"
  grep -E "^\| (ttft.p50|ttft.p95|e2e.p50) " $OUT/$run/results.md
  grep -E "^(ITL|TPOT) " $OUT/$run.txt | tr -s ' '
done
rm -f $OUT/*/*.jsonl; tar -czf $OUT/results.tgz -C $OUT B1 A1 A1b B1b 2>/dev/null; rm -rf $OUT/B1 $OUT/A1 $OUT/A1b $OUT/B1b
