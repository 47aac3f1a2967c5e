#!/usr/bin/env bash
# Session 13, call 12 (one H100): is an expand fused into the base GEMM's epilogue worth building?
# cuBLAS (+ the runtime's expand) against a Triton GEMM (+ the expand in its epilogue), 1B gate_up shapes.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 500 python3 docs/results/session13_h100_2026-11-26/call12/fused_expand.py 2>&1 | tee $OUT/output.txt
