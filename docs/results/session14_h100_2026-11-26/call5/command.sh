#!/usr/bin/env bash
# Session 14, call 5 (one H100): a prefill-heavy resident burst, A = b88ecc0 against B = this tree (the gate_up
# expand fused into the activation), A-B-B-A: 600 requests of 1,536 prompt and 32 output tokens over 32
# resident rank-16 adapters (tools/run_ab_serving.sh with INPUT_LEN/OUTPUT_LEN).
# Before the call: mkdir -p .base/b88ecc0 && git archive b88ecc0 | tar -x -C .base/b88ecc0; carry .whl and .base/b88ecc0.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
INPUT_LEN=1536 OUTPUT_LEN=32 NUM_PROMPTS=600 PYTHON=python3 SCRATCH=/tmp/scratch timeout 560 \
  bash tools/run_ab_serving.sh $OUT/long $PWD/.base/b88ecc0 $PWD > $OUT/long.txt 2>&1
echo "AB rc=$? at $((SECONDS - t0)) s"; tail -8 $OUT/long.txt; cat $OUT/long/ready.txt
for f in $OUT/long/*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -f $OUT/long/*.jsonl $OUT/long/server_*.log; rm -rf $OUT/long/scratch
