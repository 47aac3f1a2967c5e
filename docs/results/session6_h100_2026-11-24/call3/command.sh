#!/usr/bin/env bash
# session 6, call 3: serving A-B-B-A, f6180a2 (start of the session) against 7c8e9bd (fused pointwise kernels,
# one tokenizer message per client and step): base-only, then 32 resident rank-16 adapters
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
R=/tmp/r3; mkdir -p $R
A=.base/f6180a2 B=.base/7c8e9bd
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 BASE_ONLY=1 timeout 280 bash tools/run_ab_serving.sh $R/ab_base $A $B) > $R/ab_base.txt 2>&1
tail -3 $R/ab_base.txt; cat $R/ab_base/ready.txt
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 timeout 250 bash tools/run_ab_serving.sh $R/ab_adapters $A $B) > $R/ab_adapters.txt 2>&1
tail -3 $R/ab_adapters.txt
tar -czf $OUT/results.tgz -C /tmp --exclude=workload.jsonl --exclude=scratch r3
