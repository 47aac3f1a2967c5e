#!/usr/bin/env bash
# session 6, call 7: the large-adapter overlap scenario on 7c8e9bd (8B-shaped model, 32 rank-64 adapters of
# 335 MB, a GPU adapter pool of 2.7 GiB = 8 of them, distinct adapters, 128 in / 32 out, Poisson 8 req/s):
# synchronous loading, then overlap + prefetch, a fresh server each after the same 256-request warm-up.
# 200 requests per mode (400 before) and no all-at-once run, to fit one call.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/r7; mkdir -p $R
T=$PWD/.base/7c8e9bd
(cd $T && PYTHONPATH=/tmp/site:$T COMMIT=7c8e9bd SCRATCH=/tmp/scratch8b TRITON_CACHE_DIR=/tmp/tcache PARTS=large NUM_PROMPTS=200 SAT_PROMPTS=0 WARMUP_PROMPTS=256 SERVER_FLAGS="--max-model-len 2048 --lora-gpu-memory-gb 2.7" timeout 570 bash tools/run_overlap_bench.sh $R/ob) > $R/ob.txt 2>&1
tail -30 $R/ob.txt
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch8b r7
