#!/usr/bin/env bash
# session 8, call 1 (tree d37fa34): the GPU tests that capture graphs or overlap copies, on the new defaults
# (graphs up to 8,192 tokens, whole copies under 128 MB), then issue 14's no-regression run: 32 resident
# rank-16 adapters, 1,000 requests 256/128 at once, A-B-B-A, A = 7fa5372 (old defaults), B = d37fa34
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/s8c1; mkdir -p $R
t0=$SECONDS
(PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/stages/worker/test_warmup_gpu.py \
  tests/runtime/test_offline_gpu.py tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_overlap_schedule_gpu.py \
  tests/stages/worker/test_layer_waits_gpu.py tests/integration/test_overlap_gpu.py) > $R/gpu_tests.txt 2>&1
tail -3 $R/gpu_tests.txt; echo "tests done at $((SECONDS - t0)) s"
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 timeout $((560 - SECONDS + t0)) bash tools/run_ab_serving.sh $R/ab32 .base/7fa5372 $PWD) > $R/ab32.txt 2>&1
tail -9 $R/ab32.txt; cat $R/ab32/ready.txt; echo "ab done at $((SECONDS - t0)) s"
grep -h "memory pool\|captured" $R/ab32/server_*.log | cut -c1-200
for f in $R/ab32/run_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
tar -czf $OUT/results.tgz -C /tmp --exclude=workload.jsonl --exclude=abscratch s8c1
