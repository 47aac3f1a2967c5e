#!/usr/bin/env bash
# Session 14, call 10 (one H100): the session's last code (B = this tree): (1) every GPU test file of the
# kernels, the worker's graphs, overlap and warm-up, the offline engine and the overlap integration;
# (2) the resident 32-adapter burst again, B-A-A-B against f7a856c (A, .base/f7a856c: the bound's grids).
# Before the call: mkdir -p .base/f7a856c && git archive f7a856c | tar -x -C .base/f7a856c; carry .whl and .base/f7a856c.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
timeout 330 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/kernels tests/stages/worker \
  tests/runtime/test_offline_gpu.py tests/integration/test_overlap_gpu.py tests/tools/test_bench_lora_step.py \
  > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
ORDER="B A A B" PYTHON=python3 SCRATCH=/tmp/scratch timeout $((590 - SECONDS + t0)) bash tools/run_ab_serving.sh \
  $OUT/ab32 $PWD/.base/f7a856c $PWD > $OUT/ab32.txt 2>&1
echo "AB rc=$? at $((SECONDS - t0)) s"; tail -8 $OUT/ab32.txt; cat $OUT/ab32/ready.txt
for f in $OUT/ab32/*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -f $OUT/ab32/*.jsonl $OUT/ab32/server_*.log; rm -rf $OUT/ab32/scratch
