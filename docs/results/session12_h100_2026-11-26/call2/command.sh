#!/usr/bin/env bash
# session 12, call 2 (tree 5785a16): why overlapped loading gains nothing on an idle server (call 1: TTFT
# P50 22.4 ms overlapped, 22.2 ms synchronous, at 1 req/s). The large-adapter scenario at 1 req/s, 20
# requests a mode, with the worker's device trace over plans 300-419 (about requests 5 to 8 of the run):
# (p8) 8 pool slots, every request loads its adapter, sync then overlap; (p32) 32 slots, all adapters
# resident after the warm-up (no loads), sync then overlap. episodes.py prints each request's device
# timeline: the adapter copy, the first kernel, the compute stream's gaps, the first token's readback.
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
for run in p8 p32; do
  if [ $run = p8 ]; then slots=8 gb=2.7; else slots=32 gb=11.5; fi
  mkdir -p /tmp/prof_$run
  (SCRATCH=$S TRITON_CACHE_DIR=/tmp/tcache PARTS=large RATE=1 NUM_PROMPTS=20 SAT_PROMPTS=0 WARMUP_PROMPTS=64 \
    SLOTS=$slots COMMIT=5785a16 SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb $gb --profile-dir /tmp/prof_$run --profile-steps 300:120" \
    timeout $((560 - SECONDS + t0)) bash tools/run_overlap_bench.sh /tmp/$run) > $OUT/$run.txt 2>&1
  echo "$run rc=$? at $((SECONDS - t0)) s"
  grep -E "^\| large r1 (sync|overlap) " /tmp/$run/results.md
  for f in $(ls -tr /tmp/prof_$run/*.json.gz); do python3 docs/results/session12_h100_2026-11-26/call2/episodes.py $f; done
  grep -h "step profile" /tmp/$run/server_large_*.log | cut -c1-200
done
rm -f /tmp/p8/*.jsonl /tmp/p32/*.jsonl
tar -czf $OUT/results.tgz -C /tmp p8 p32 prof_p8 prof_p32
ls -la $OUT
