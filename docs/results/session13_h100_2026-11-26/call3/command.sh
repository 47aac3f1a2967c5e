#!/usr/bin/env bash
# Session 13, call 3 (one H100): a graphed step's kernel configs (the shrink's split-K and column block)
# chosen as if it had N tiles instead of its padded tile bound, on eight steps:
# tools/bench_lora_step.py STEP --only "graphed bm16 (bound" --config-tiles 0,16,32,64,128
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
C1=""; C2="--decodes 256 --prefill="
C3="--adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $(printf '256,%.0s' $(seq 30))256"
C4="--decodes 100 --prefill 1024,1024,1024,1024,512"
C5="--adapters 32 --ranks 16 --decodes 256 --prefill="
C6="--adapters 256 --pool-gb 12 --decodes 256 --prefill="
C7="--adapters 8 --ranks 16 --decodes 256 --prefill="
C8="--adapters 16 --decodes 64 --prefill="
for c in C2 C5 C6 C7 C8 C1 C3 C4; do
  echo "== $c (${!c})"
  python3 -m tools.bench_lora_step ${!c} --only "graphed bm16 (bound" --config-tiles 0,16,32,64,128 \
    --out $OUT/$c.json 2>&1 | grep -E " us |Error|error"
done
echo "done at $((SECONDS - t0)) s"
