#!/usr/bin/env bash
# Prepared for the next session, not run: (1) every GPU test on the tree (this session ran only the four files
# its worker change touches); (2) issue 6's decode-ITL-under-loads part of the overlap bench, 6a667ee (steps
# on a loading adapter eager) against this tree (layer-gated step graphs), A-B on one machine. Each 'itl' run
# starts two servers on the 8B model (about 100 s to generate first). If it does not fit one call, run the
# tests in one call and the ITL pair in the next.
# Before the call: mkdir -p .base/6a667ee && git archive 6a667ee | tar -x -C .base/6a667ee; carry .whl and .base/6a667ee.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/stages/worker/test_warmup_gpu.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/kernels/test_triton_backend.py tests/runtime/test_offline_gpu.py \
  tests/stages/worker/test_overlap_schedule_gpu.py tests/stages/worker/test_layer_waits_gpu.py \
  tests/integration/test_overlap_gpu.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -3 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
for side in A B; do
  if [ $side = A ]; then T=$PWD/.base/6a667ee; else T=$PWD; fi
  (cd $T && PYTHONPATH=/tmp/site:$T SCRATCH=/tmp/scratch8b TRITON_CACHE_DIR=/tmp/tcache PARTS=itl ITL_REPEATS=1 \
    COMMIT=$side SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb 2.7" \
    timeout $((585 - SECONDS + t0)) bash tools/run_overlap_bench.sh $OUT/$side) > $OUT/$side.txt 2>&1
  echo "$side rc=$? at $((SECONDS - t0)) s"; cat $OUT/$side/itl_overlap.md 2>/dev/null | head -12
done
rm -f $OUT/*/*.jsonl
