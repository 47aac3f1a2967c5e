#!/usr/bin/env bash
# Session 15, call 2 (one H100): the shrink's config on many-adapter decode steps (shrink_sweep.py).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
python3 docs/results/session15_h100_2026-11-26/call2/shrink_sweep.py 2>&1 | tee $OUT/output.txt
