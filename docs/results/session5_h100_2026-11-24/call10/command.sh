#!/usr/bin/env bash
# call 10: served GPU busy (steps 800-999 of the measured burst) on b00db3b, with start-up objects frozen out
# of the collector: base-only twice and 32 adapters twice, overlapped
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r10; mkdir -p $R
T=.base/b00db3b
run() {  # $1 label, rest: env assignments
  local label=$1; shift
  (env "$@" PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 ORDER=B \
    timeout 150 bash tools/run_ab_serving.sh $R/$label $T $T) > $R/$label.txt 2>&1
  grep -h "step profile" $R/$label/server_B1.log | grep wall | sed 's/^/'"$label"': /' | cut -c1-260
}
run base1 BASE_ONLY=1 "B_FLAGS=--profile-dir $R/p1 --profile-steps 800:200"
run adapters1 "B_FLAGS=--profile-dir $R/p2 --profile-steps 800:200"
run base2 BASE_ONLY=1 "B_FLAGS=--profile-dir $R/p3 --profile-steps 800:200"
run adapters2 "B_FLAGS=--profile-dir $R/p4 --profile-steps 800:200"
tar -czf $OUT/results.tgz -C /tmp --exclude='p[0-9]' --exclude='workload.jsonl' --exclude='scratch' r10
