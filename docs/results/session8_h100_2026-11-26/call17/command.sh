#!/usr/bin/env bash
# session 8, call 17 (tree 6d953c6): one step's LoRA kernels with several column blocks per expand program
# (col_chunk 2, 4, 8; 2 or 3 pipeline stages; the tile's metadata, rank and row gather loaded once), against
# the graphed default, on the four cases of call 5
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
R=$OUT/s8c17; mkdir -p $R
P=$(python3 -c "print(','.join(['256'] * 31))")
for rep in 1 2; do
  echo "== mixed ($rep)"; timeout 60 python3 -m tools.bench_lora_step --out $R/mixed_$rep.json 2>&1 | grep -v Warn | grep "bound 320"
  echo "== decode ($rep)"; timeout 60 python3 -m tools.bench_lora_step --decodes 256 --prefill "" --out $R/decode_$rep.json 2>&1 | grep -v Warn | grep "bm16"
done
echo "== resident"; timeout 60 python3 -m tools.bench_lora_step --adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $P --out $R/resident.json 2>&1 | grep -v Warn | grep "bm16"
echo "== large"; timeout 60 python3 -m tools.bench_lora_step --decodes 100 --prefill 1024,1024,1024,1024,512 --out $R/large.json 2>&1 | grep -v Warn | grep "bm16"
