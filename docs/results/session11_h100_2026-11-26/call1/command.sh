#!/usr/bin/env bash
# session 11, call 1: external-event wait nodes in CUDA graphs (semantics, a cycle, cost)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 docs/results/session11_h100_2026-11-26/call1/event_gates.py 2>&1 | tee $OUT/event_gates.txt
