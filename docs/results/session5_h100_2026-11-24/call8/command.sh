#!/usr/bin/env bash
# call 8: server-side GPU busy (worker step profiler, steps 800-999: inside the measured burst, after the
# 1,000-request warm-up burst) on a03d9f4: base-only and 32 adapters overlapped, 32 adapters serial
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r8; mkdir -p $R
T=.base/a03d9f4
run() {  # $1 label, rest: env assignments
  local label=$1; shift
  (env "$@" PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 ORDER=B \
    timeout 170 bash tools/run_ab_serving.sh $R/$label $T $T) > $R/$label.txt 2>&1
  grep -h "step profile" $R/$label/server_B1.log | sed 's/^/'"$label"': /'
  grep -E "^\| B1" $R/$label.txt
}
run base BASE_ONLY=1 "B_FLAGS=--profile-dir $R/prof_base --profile-steps 800:200"
run adapters "B_FLAGS=--profile-dir $R/prof_adapters --profile-steps 800:200"
run adapters_serial "B_FLAGS=--profile-dir $R/prof_serial --profile-steps 800:200 --no-overlap-schedule"
ls -la $R/prof_*
rm -rf $R/prof_*/*.json.gz.tmp
mkdir -p $R/traces; cp $R/prof_adapters/*.json.gz $R/traces/ 2>/dev/null
tar -czf $OUT/results.tgz -C /tmp --exclude='prof_*' --exclude='workload.jsonl' --exclude='scratch' r8
