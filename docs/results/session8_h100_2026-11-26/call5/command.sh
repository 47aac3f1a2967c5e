#!/usr/bin/env bash
# session 8, call 5 (tree d37fa34 + tools/bench_lora_step.py with --ranks/--sweep): the LoRA kernels of one
# step on the 16-token tile with a tile bound of bucket/16 + max sequences, and kernel configs around the
# heuristic's; cases: S2-like mixed step, decode step, large prefill step, the resident 32-adapter run's step
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
R=$OUT/s8c5; mkdir -p $R
echo "== mixed: 190 decodes + prefill chunks 512,256"; timeout 200 python3 -m tools.bench_lora_step --sweep --out $R/mixed.json
echo "== decode: 256 decodes"; timeout 150 python3 -m tools.bench_lora_step --decodes 256 --prefill "" --sweep --out $R/decode.json
P=$(python3 -c "print(','.join(['256'] * 31))")
echo "== resident-like: 32 rank-16 adapters, 64 decodes + 31 x 256 prefill, 7 GB pool"; timeout 150 python3 -m tools.bench_lora_step --adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $P --sweep --out $R/resident.json
echo "== large: 100 decodes + 4 x 1024 + 512 prefill"; timeout 60 python3 -m tools.bench_lora_step --decodes 100 --prefill 1024,1024,1024,1024,512 --out $R/large.json
