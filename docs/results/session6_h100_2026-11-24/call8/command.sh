#!/usr/bin/env bash
# session 6, call 8 (tree 7c8e9bd): the fused pointwise kernels once the tokenizer keeps up (A-B-B-A,
# base-only, one tree: A = --pointwise-backend torch, B = the default, triton); then the served GPU-busy
# share of steps 800-999 base-only (call 4's first base-only window was lost to a script error)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/r8; mkdir -p $R
T=.base/7c8e9bd
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 BASE_ONLY=1 A_FLAGS="--pointwise-backend torch" timeout 300 bash tools/run_ab_serving.sh $R/ab_pointwise $T $T) > $R/ab_pointwise.txt 2>&1
tail -9 $R/ab_pointwise.txt
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 ORDER=B BASE_ONLY=1 B_FLAGS="--profile-dir $R/base3/p --profile-steps 800:200" timeout 120 bash tools/run_ab_serving.sh $R/base3 $T $T) > $R/base3.txt 2>&1
grep -h "step profile" $R/base3/server_B1.log | grep wall | cut -c1-300
for t in $R/base3/p/*.json.gz; do PYTHONPATH=/tmp/site:$T python3 -m tools.gpu_timeline $t --top 20 > $R/base3/timeline.txt; done
rm -rf $R/base3/p
tar -czf $OUT/results.tgz -C /tmp --exclude=workload.jsonl --exclude=scratch r8
