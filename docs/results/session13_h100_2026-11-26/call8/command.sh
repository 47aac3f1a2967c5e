#!/usr/bin/env bash
# Session 13, call 8 (one H100, this tree): session 12's prepared ITL pair: issue 6's decode ITL while 30
# adapters load, with tools/run_overlap_bench.sh's 'itl' pool for all adapters (ITL_POOL_GB default, not
# yet run on a GPU), ITL_REPEATS=2 (A-B-B-A within the one server; 8B shape, 32 rank-64 adapters).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
S=/tmp/scratch8b
mkdir -p $S
(SCRATCH=$S TRITON_CACHE_DIR=/tmp/tcache PARTS=itl ITL_REPEATS=2 SERVER_FLAGS="--max-model-len 2048" \
  timeout $((590 - SECONDS + t0)) bash tools/run_overlap_bench.sh $OUT/itl) > $OUT/itl.txt 2>&1
echo "itl rc=$? at $((SECONDS - t0)) s"; head -20 $OUT/itl/itl_overlap.md
grep -h "lora-gpu-memory-gb\|pool" $OUT/itl.txt | head -3
rm -f $OUT/*/*.jsonl; rm -rf $OUT/itl/scratch
