#!/usr/bin/env bash
# Session 14, call 13 (one H100): the expand's config on decode steps with tile-class grids (expand_sweep.py).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
PYTHONPATH=/tmp/site:$PWD python3 docs/results/session14_h100_2026-11-26/call13/expand_sweep.py
