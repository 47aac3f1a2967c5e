#!/usr/bin/env bash
# session 12, call 1 (tree 5785a16): (1) every GPU test file on the tree, while the 8B model and its 32
# rank-64 adapters are generated on the other cores; (2) the large-adapter overlap scenario on an idle
# server (Poisson 1 req/s, 30 requests a mode: each request arrives alone, so its TTFT has no queueing
# behind other requests' plans), the lower bound of the overlap/sync TTFT ratio; (3) the same scenario at
# its usual 8 req/s (60 requests a mode) on the same machine, for reference.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
S=/tmp/scratch8b M=/tmp/scratch8b/llama-8b-bfloat16 AD=/tmp/scratch8b/adapters-8b-r64-n32-bfloat16
mkdir -p $S
( taskset -c 8-15 python3 -m tools.make_tiny_model $M --preset 8b --dtype bfloat16 --seed 0 && touch $M/.complete ) > $OUT/gen.txt 2>&1 &
gen=$!
until [ -f $M/config.json ] || ! kill -0 $gen 2>/dev/null; do sleep 0.5; done
( taskset -c 8-15 python3 -m tools.make_adapters $M $AD --n 32 --ranks 64 --targets all --dtype bfloat16 --seed 0 >/dev/null \
  && touch $AD/.complete ) >> $OUT/gen.txt 2>&1 &
adp=$!
taskset -c 0-7 timeout 330 python3 -m pytest -q -p no:cacheprovider -p no:randomly \
  tests/integration/test_overlap_gpu.py tests/kernels/test_paged_attention.py tests/kernels/test_triton_backend.py \
  tests/runtime/common/test_host_pool.py tests/runtime/test_offline_gpu.py tests/stages/worker/test_decode_graphs.py \
  tests/stages/worker/test_layer_waits_gpu.py tests/stages/worker/test_lora_pool.py \
  tests/stages/worker/test_overlap_schedule_gpu.py tests/stages/worker/test_step_graphs.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_warmup.py tests/stages/worker/test_warmup_gpu.py \
  > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -2 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
wait $gen $adp; echo "generated at $((SECONDS - t0)) s"
for r in 1 8; do
  if [ $r = 1 ]; then n=30; else n=60; fi
  (SCRATCH=$S TRITON_CACHE_DIR=/tmp/tcache PARTS=large RATE=$r NUM_PROMPTS=$n SAT_PROMPTS=0 WARMUP_PROMPTS=64 \
    COMMIT=5785a16 SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb 2.7" \
    timeout $((585 - SECONDS + t0)) bash tools/run_overlap_bench.sh $OUT/r$r) > $OUT/r$r.txt 2>&1
  echo "rate $r rc=$? at $((SECONDS - t0)) s"
  grep -E "^\| (ttft.p50|ttft.p95|e2e.p50) " $OUT/r$r/results.md
  grep -E "^(ITL|TPOT) " $OUT/r$r.txt | tr -s ' '
done
rm -f $OUT/*/*.jsonl; tar -czf $OUT/results.tgz -C $OUT r1 r8 && rm -rf $OUT/r1 $OUT/r8
