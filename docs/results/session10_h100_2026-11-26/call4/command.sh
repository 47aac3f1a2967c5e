#!/usr/bin/env bash
# session 10, call 4: the new default (--adapter-affinity-steps 200) without the flag: S2 on one server
# (mix base mix), then issue 14's no-regression pair, the resident 32-adapter burst A-B-B-A with
# A = --adapter-affinity-steps 0 (queue order, as before) and B = the default, and the offline GPU test.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3 SERVER_FLAGS="$F" S2_PASSES="mix base mix" S2_RATE_RUN=0 \
  timeout 220 bash tools/run_churn_bench.sh $OUT/s2 > $OUT/s2.txt 2>&1
echo "S2 rc=$? at $((SECONDS - t0)) s"; grep -A8 "^| run" $OUT/s2.txt | head -8
A_FLAGS="--adapter-affinity-steps 0" PYTHON=python3 SCRATCH=/tmp/scratch timeout 260 bash tools/run_ab_serving.sh $OUT/ab32 $PWD $PWD > $OUT/ab32.txt 2>&1
echo "AB rc=$? at $((SECONDS - t0)) s"; tail -8 $OUT/ab32.txt
timeout $((575 - SECONDS + t0)) python3 -m pytest -q -p no:cacheprovider tests/runtime/test_offline_gpu.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -2 $OUT/gpu_tests.txt
for f in $OUT/s2/s2_*.json $OUT/ab32/*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
