#!/usr/bin/env bash
# Session 17, call 3 (one H100, this working tree: the sampler's finiteness check from max and min, the
# stages' garbage-collection pause timer): the sampler's check three ways; the GPU tests of the sampler,
# step isolation, the offline engine against PEFT and the pause timer; then issue 14's S2 on one server,
# mix then base-only, whose log has every collection that stopped a stage for 20 ms or more.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
python3 docs/results/session17_h100_2026-11-26/call3/sampler_check.py 2>&1 | tee $OUT/sampler.txt
timeout 240 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/stages/worker/test_sampler.py \
  tests/stages/worker/test_step_isolation.py tests/runtime/test_offline_gpu.py tests/runtime/base/test_gc_pauses.py \
  2>&1 | tail -3 | tee $OUT/gpu_tests.txt
echo "tests done at $((SECONDS - t0)) s"
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3 SERVER_FLAGS="$F" S2_PASSES="mix base" S2_RATE_RUN=0 \
  timeout $((585 - SECONDS + t0)) bash tools/run_churn_bench.sh $OUT/s2 > $OUT/s2.txt 2>&1
echo "s2 rc=$? at $((SECONDS - t0)) s"
python3 -m tools.bench_runs $OUT/s2/s2_*.json 2>/dev/null
grep -h "ready\|garbage collection" $OUT/s2/server_s2.log | grep -v "warm-up" | cut -c1-220 | tee $OUT/gc_pauses.txt | tail -40
for f in $OUT/s2/s2_*.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -rf $OUT/s2/scratch $OUT/s2/*.jsonl
