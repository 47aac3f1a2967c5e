#!/usr/bin/env bash
# session 11, call 5: saturating throughput, the light-load plan depth against the fixed 3 plans. Issue 15's
# workload (1B-shaped model, 1,000 requests of 256 in / 128 out at once), A-B-B-A: A = eaca1c1 (.base/eaca1c1,
# fixed 3 plans), B = this tree; with 32 resident rank-16 adapters, then base-only.
# Before the call: mkdir -p .base/eaca1c1 && git archive eaca1c1 | tar -x -C .base/eaca1c1; carry .whl and .base/eaca1c1.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
F="--max-loras-per-batch 32 --max-cpu-loras 32 --max-lora-rank 16 --max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192"
for kind in adapters base; do
  extra=(); [ $kind = base ] && extra=(env BASE_ONLY=1)
  "${extra[@]:-env}" PYTHON=python3 SCRATCH=/tmp/scratch1b TRITON_CACHE_DIR=/tmp/tcache SERVER_FLAGS="$F" \
    timeout $((585 - SECONDS + t0)) bash tools/run_ab_serving.sh $OUT/$kind $PWD/.base/eaca1c1 $PWD > $OUT/$kind.txt 2>&1
  echo "$kind rc=$? at $((SECONDS - t0)) s"; tail -8 $OUT/$kind.txt
  python3 -m tools.bench_runs --strip $OUT/$kind/run_*.json
done
rm -f $OUT/*/*.jsonl
