#!/usr/bin/env bash
# session 6, call 4 (tree 7c8e9bd): what the fused pointwise kernels give once the tokenizer keeps up
# (A-B-B-A, base-only: A = --pointwise-backend torch, B = the default triton, same tree); then the served
# GPU-busy share of steps 800-999, base-only twice and 32 adapters twice
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r4; mkdir -p $R
T=.base/7c8e9bd
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 BASE_ONLY=1 "A_FLAGS=--pointwise-backend torch" timeout 260 bash tools/run_ab_serving.sh $R/ab_pointwise $T $T) > $R/ab_pointwise.txt 2>&1
tail -3 $R/ab_pointwise.txt
run() {  # $1 label, rest: env assignments
  local label=$1; shift
  (env "$@" PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 ORDER=B \
    timeout 100 bash tools/run_ab_serving.sh $R/$label $T $T) > $R/$label.txt 2>&1
  grep -h "step profile" $R/$label/server_B1.log | grep wall | sed 's/^/'"$label"': /' | cut -c1-300
  for t in $R/$label/p/*.json.gz; do PYTHONPATH=/tmp/site:$T python3 -m tools.gpu_timeline $t --top 20 > $R/$label/timeline.txt; done
  rm -rf $R/$label/p
}
run base1 BASE_ONLY=1 "B_FLAGS=--profile-dir $R/base1/p --profile-steps 800:200"
run adapters1 "B_FLAGS=--profile-dir $R/adapters1/p --profile-steps 800:200"
run base2 BASE_ONLY=1 "B_FLAGS=--profile-dir $R/base2/p --profile-steps 800:200"
run adapters2 "B_FLAGS=--profile-dir $R/adapters2/p --profile-steps 800:200"
tar -czf $OUT/results.tgz -C /tmp --exclude=workload.jsonl --exclude=scratch r4
