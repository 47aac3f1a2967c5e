#!/usr/bin/env bash
# Session 13, call 13 (one H100): cuBLAS with beta 1 (y.addmm_) against beta 0, and the bytes of a
# read-modify-write pass against a store-only pass, on the 1B projections.
set -u
timeout 300 python3 docs/results/session13_h100_2026-11-26/call13/addmm_beta.py 2>&1 | tee $OUT/output.txt
