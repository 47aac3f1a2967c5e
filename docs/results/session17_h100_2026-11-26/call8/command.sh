#!/usr/bin/env bash
# Session 17, call 8 (one H100): B = c9af04b (this tree: the sampler reads each request's logits row in
# the forward's own order, no [B, V] gather) against A = c6b3086 (.base/c6b). First the GPU tests of the
# sampler, the executor's isolation, the offline engine against PEFT, decode and step graphs and layer
# waits on B; then issue 14's S2 (as call 4), A-B-B-A, a fresh server each, the mix on every server and
# base-only on the first and last.
# Before the call: mkdir -p .base/c6b && git archive c6b3086 | tar -x -C .base/c6b --exclude=docs;
# carry .whl and .base/c6b.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
t0=$SECONDS
(PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache timeout 200 python3 -m pytest -q -p no:randomly -p no:cacheprovider \
  tests/stages/worker/test_sampler.py tests/stages/worker/test_step_isolation.py tests/runtime/test_offline_gpu.py \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_layer_waits_gpu.py \
  2>&1 | tail -3) | tee $OUT/gpu_tests.txt
echo "tests done at $((SECONDS - t0)) s"
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
n=0
for side in A B B A; do
  n=$((n + 1))
  if [ $side = A ]; then T=$PWD/.base/c6b; else T=$PWD; fi
  if [ $n = 1 ] || [ $n = 4 ]; then passes="mix base"; else passes="mix"; fi
  (cd $T && PYTHONPATH=/tmp/site:$T TRITON_CACHE_DIR=/tmp/tcache SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 \
    PYTHON=python3 SERVER_FLAGS="$F" S2_PASSES="$passes" S2_RATE_RUN=0 \
    timeout $((590 - SECONDS + t0)) bash tools/run_churn_bench.sh $OUT/$side$n) > $OUT/$side$n.txt 2>&1
  echo "$side$n rc=$? at $((SECONDS - t0)) s"
  (cd $PWD && PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_runs $OUT/$side$n/s2_*.json 2>/dev/null)
done
for f in $OUT/*/s2_*.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -f $OUT/*/*.jsonl; tar -czf $OUT/results.tgz -C $OUT A1 B2 B3 A4 2>/dev/null; rm -rf $OUT/A1 $OUT/B2 $OUT/B3 $OUT/A4
