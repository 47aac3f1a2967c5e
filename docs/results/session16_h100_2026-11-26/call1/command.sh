#!/usr/bin/env bash
# Session 16, call 1 (one H100): shrink_reduce.patch applied (B), on an empty Triton cache, the GPU test
# files that failed cold in session 15's call 10, with the capture probe logging every compile and
# capture.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
D=docs/results/session16_h100_2026-11-26/call1
export PYTHONPATH=/tmp/site:$PWD:$PWD/$D
export TRITON_CACHE_DIR=$(mktemp -d)
L="tests/kernels tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_step_graphs_gpu.py
tests/stages/worker/test_warmup_gpu.py tests/runtime/test_offline_gpu.py"
PROBE_TAG=B timeout 540 python3 -m pytest -q -x -p no:randomly -p capture_probe $L > $OUT/B.txt 2>&1
echo "rc $?"; tail -5 $OUT/B.txt; grep -c "capture start" $OUT/B.log; grep -m5 "IN-CAPTURE\|FAILED" $OUT/B.log
