#!/usr/bin/env bash
# Session 14, call 3 (one H100): the gate_up expand fused into the activation for batches of more tokens
# than sequences (B = this tree) against b88ecc0 (A, .base/b88ecc0): (1) the GPU tests of the kernels,
# backend, decode and step graphs, warm-up (no compile after it) and the offline engine; (2) the resident
# 32-adapter burst A-B-B-A (tools/run_ab_serving.sh).
# Before the call: mkdir -p .base/b88ecc0 && git archive b88ecc0 | tar -x -C .base/b88ecc0; carry .whl and .base/b88ecc0.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/kernels \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_step_graphs_gpu.py \
  tests/stages/worker/test_warmup_gpu.py tests/runtime/test_offline_gpu.py tests/stages/worker/test_warmup_plan.py \
  tests/tools/test_bench_lora_step.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
PYTHON=python3 SCRATCH=/tmp/scratch timeout $((590 - SECONDS + t0)) bash tools/run_ab_serving.sh $OUT/ab32 \
  $PWD/.base/b88ecc0 $PWD > $OUT/ab32.txt 2>&1
echo "AB rc=$? at $((SECONDS - t0)) s"; tail -8 $OUT/ab32.txt; cat $OUT/ab32/ready.txt
for f in $OUT/ab32/*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -f $OUT/ab32/*.jsonl; rm -rf $OUT/ab32/scratch
