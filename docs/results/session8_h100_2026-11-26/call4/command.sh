#!/usr/bin/env bash
# session 8, call 4 (tree d37fa34 + tools/bench_lora_step.py): one multi-tenant step's LoRA kernels (1B
# shapes, 80 distinct adapters of ranks 8/16/32/64 at scattered rows of a 4 GB pool), as graphed now
# (grid of the bucket's tile bound) against tighter bounds and other token tiles
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
R=$OUT/s8c4; mkdir -p $R
echo "== mixed: 190 decodes + prefill chunks 512,256"; python3 -m tools.bench_lora_step --out $R/mixed.json
echo "== decode: 256 decodes"; python3 -m tools.bench_lora_step --decodes 256 --prefill "" --out $R/decode.json
echo "== large: 100 decodes + 4 x 1024 + 512 prefill"; python3 -m tools.bench_lora_step --decodes 100 --prefill 1024,1024,1024,1024,512 --out $R/large.json
echo "== mixed, 40 adapters"; python3 -m tools.bench_lora_step --adapters 40 --out $R/mixed40.json
