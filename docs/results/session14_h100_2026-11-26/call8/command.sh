#!/usr/bin/env bash
# Session 14, call 8 (one H100): where a decode step's LoRA time goes (decode_parts.py beside this).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
PYTHONPATH=/tmp/site:$PWD python3 docs/results/session14_h100_2026-11-26/call8/decode_parts.py
