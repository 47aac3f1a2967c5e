#!/usr/bin/env bash
# Session 18, call 2 (one H100): where PDL pays and where it costs. The working copy's kernels read
# EXP_* switches (shrink launched as a dependent or not; its trigger at the top, after its K loop or
# never; the expand's trigger at its top or never); pdl_steps.py times each variant against PDL off in
# one process, off M1 M2 M4 M5 M5 M4 M2 M1 off, LoRA kernels alone and with each group's GEMM before them,
# and checks every variant's outputs equal PDL off's bit for bit.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export TRITON_CACHE_DIR=/tmp/tcache PYTHONPATH=/tmp/site:$PWD
timeout 580 python3 docs/results/session18_h100_2026-11-26/call2/pdl_steps.py 2>&1 | tee $OUT/pdl_steps.txt
