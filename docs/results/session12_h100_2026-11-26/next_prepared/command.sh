#!/usr/bin/env bash
# Prepared for the next session, not run. Before the call, re-apply this session's two reverted follow-ups
# (`git revert --no-edit 97f2979 032ae1b`: upload copies when the mapping is on another device than the
# destination; HostStaging built from two PinnedBuffers), then on one H100 (name nvidia-h100-x1):
# (1) every GPU test file, tests/kernels/test_host_copy.py included;
# (2) issue 6's decode ITL under loads with the script's new pool default, ITL_REPEATS=2 (A-B-B-A within
#     the one server), on this tree only: the ratio that calls 8 and 9 of session 12 could not give.
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
taskset -c 0-7 timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/kernels/test_host_copy.py \
  tests/integration/test_overlap_gpu.py tests/kernels/test_paged_attention.py tests/kernels/test_triton_backend.py \
  tests/runtime/common/test_host_pool.py tests/runtime/test_offline_gpu.py tests/stages/worker/test_decode_graphs.py \
  tests/stages/worker/test_layer_waits_gpu.py tests/stages/worker/test_lora_pool.py \
  tests/stages/worker/test_overlap_schedule_gpu.py tests/stages/worker/test_step_graphs.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_warmup.py tests/stages/worker/test_warmup_gpu.py \
  > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -2 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
wait; echo "generated at $((SECONDS - t0)) s"
(SCRATCH=$S TRITON_CACHE_DIR=/tmp/tcache PARTS=itl ITL_REPEATS=2 SERVER_FLAGS="--max-model-len 2048" \
  timeout $((590 - SECONDS + t0)) bash tools/run_overlap_bench.sh $OUT/itl) > $OUT/itl.txt 2>&1
echo "itl rc=$? at $((SECONDS - t0)) s"; head -14 $OUT/itl/itl_overlap.md
rm -f $OUT/*/*.jsonl
