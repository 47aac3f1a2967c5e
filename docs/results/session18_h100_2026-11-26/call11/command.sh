#!/usr/bin/env bash
# Session 18, call 11 (one H100): whole model steps with the LoRA kernels in plain order against them as
# programmatic dependents (this tree, 2351ee6), one process, two runners (model_steps.py): a 256-decode
# step and a 190-decode + 768-prefill step over 62 adapters of ranks 8-64, and the same steps base-only.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export TRITON_CACHE_DIR=/tmp/tcache PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
M=/tmp/m1b AD=/tmp/mix
python3 -m tools.make_tiny_model $M --preset 1b --dtype bfloat16 --seed 0 > /dev/null 2>&1
python3 -m tools.make_adapters $M $AD --n 64 --ranks 8,16,32,64 --targets all --dtype bfloat16 --seed 2 > /dev/null 2>&1
echo "model and adapters at $((SECONDS - t0)) s"
timeout 420 python3 docs/results/session18_h100_2026-11-26/call11/model_steps.py $M $AD 2>&1 | grep -v "^$" | tail -8 | tee $OUT/model_steps.txt
echo "done at $((SECONDS - t0)) s"
