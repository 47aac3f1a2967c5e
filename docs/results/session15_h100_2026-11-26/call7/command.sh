#!/usr/bin/env bash
# Session 15, call 7 (one H100): the committed rule (the shrink sums its partials; split target two
# programs an SM for rank tiles above 16, one for 16) as B against A = fd2eb4a, A-B-B-A over the decode,
# mixed and prefill steps of calls 5 and 6; the GPU tests of kernels, backend, graphs, warm-up, overlap
# and PEFT parity; then issue 14's S2 (the mix, then base-only, one server) on B.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
D=docs/results/session15_h100_2026-11-26/call7
for t in A B B A; do
  tree=$PWD; [ $t = A ] && tree=$PWD/.base/fd2eb4a
  echo "== $t"; PYTHONPATH=/tmp/site python3 $D/../steps_ab.py $tree all
done 2>&1 | tee $OUT/output.txt
export PYTHONPATH=/tmp/site:$PWD
timeout 300 python3 -m pytest -q -p no:randomly tests/kernels \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_step_graphs_gpu.py \
  tests/stages/worker/test_warmup_gpu.py tests/runtime/test_offline_gpu.py tests/tools/test_bench_lora_step.py \
  tests/stages/worker/test_overlap_schedule_gpu.py tests/stages/worker/test_layer_waits_gpu.py \
  tests/integration/test_overlap_gpu.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
echo "tests done at $((SECONDS - t0)) s"
R=/tmp/s15c7; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
(SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PYTHON=python3 SERVER_FLAGS="$F" PARTS=s2 \
  S2_PASSES="mix base" S2_RATE_RUN=0 timeout $((590 - SECONDS + t0)) bash tools/run_churn_bench.sh $R/s2) > $R/s2.txt 2>&1
echo "S2 rc=$? at $((SECONDS - t0)) s"
python3 -m tools.bench_runs $R/s2/s2_*.json | tee $OUT/s2_runs.txt
grep -h "ready\|ratio" $R/s2.txt | head -5
