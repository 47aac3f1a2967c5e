#!/usr/bin/env bash
# session 12, call 8 (an H100, warm from calls 6-7): (1) the GPU test files on this tree, as call 4 ran them
# on an H200, while the 8B model is generated on other cores; (2) issue 6's decode ITL of resident requests
# while 30 rank-64 adapters load (the 'itl' part of run_overlap_bench.sh, one pair of runs a side), A =
# 5785a16 (.base/5785a16) then B = this tree (step inputs uploaded by kernels, kernels/host_copy).
# Before the call: mkdir -p .base/5785a16 && git archive 5785a16 | tar -x -C .base/5785a16; carry .whl and .base/5785a16.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
S=/tmp/scratch8b M=/tmp/scratch8b/llama-8b-bfloat16 AD=/tmp/scratch8b/adapters-8b-r64-n32-bfloat16
mkdir -p $S
if [ ! -f $AD/.complete ]; then
  ( taskset -c 8-15 python3 -m tools.make_tiny_model $M --preset 8b --dtype bfloat16 --seed 0 && touch $M/.complete ) > $OUT/gen.txt 2>&1 &
  gen=$!
  until [ -f $M/config.json ] || ! kill -0 $gen 2>/dev/null; do sleep 0.5; done
  ( taskset -c 8-15 python3 -m tools.make_adapters $M $AD --n 32 --ranks 64 --targets all --dtype bfloat16 --seed 0 >/dev/null \
    && touch $AD/.complete ) >> $OUT/gen.txt 2>&1 &
  adp=$!
fi
taskset -c 0-7 timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/kernels/test_host_copy.py \
  tests/integration/test_overlap_gpu.py tests/kernels/test_paged_attention.py tests/kernels/test_triton_backend.py \
  tests/runtime/common/test_host_pool.py tests/runtime/test_offline_gpu.py tests/stages/worker/test_decode_graphs.py \
  tests/stages/worker/test_layer_waits_gpu.py tests/stages/worker/test_lora_pool.py \
  tests/stages/worker/test_overlap_schedule_gpu.py tests/stages/worker/test_step_graphs.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_warmup.py tests/stages/worker/test_warmup_gpu.py \
  > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -2 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
wait; echo "generated at $((SECONDS - t0)) s"
for side in A B; do
  if [ $side = A ]; then T=$PWD/.base/5785a16; else T=$PWD; fi
  (cd $T && PYTHONPATH=/tmp/site:$T SCRATCH=$S TRITON_CACHE_DIR=/tmp/tcache PARTS=itl ITL_REPEATS=1 \
    COMMIT=$side SERVER_FLAGS="--max-model-len 2048" \
    timeout $((590 - SECONDS + t0)) bash tools/run_overlap_bench.sh $OUT/$side) > $OUT/$side.txt 2>&1
  echo "$side rc=$? at $((SECONDS - t0)) s"; cat $OUT/$side/itl_overlap.md 2>/dev/null | head -14
done
rm -f $OUT/*/*.jsonl; tar -czf $OUT/results.tgz -C $OUT A B 2>/dev/null; rm -rf $OUT/A $OUT/B
