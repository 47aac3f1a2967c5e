#!/usr/bin/env bash
# Session 19, call 4 (one H100): a persistent TMA Triton GEMM with the LoRA delta as extra K steps,
# three placements of the LoRA steps (after the main loop over the whole rank tile, after it 16 rank rows a dot up to each adapter's rank, before it likewise), against cuBLAS and the runtime's expand, on the 1B model's four projections (a measurement).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
timeout 560 python3 docs/results/session19_h100_2026-11-26/call4/fused_gemm.py 2>&1 | tee $OUT/output.txt
