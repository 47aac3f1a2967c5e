#!/usr/bin/env bash
# session 8, call 16 (tree with ExpandConfig.columns_first): one step's LoRA kernels with the expand's grid
# in the other order (column blocks fastest, so the programs running at once read one adapter's B rows
# along their length), against the graphed default, on the four cases of call 5
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
R=$OUT/s8c16; mkdir -p $R
P=$(python3 -c "print(','.join(['256'] * 31))")
for rep in 1 2; do
  echo "== mixed ($rep)"; timeout 60 python3 -m tools.bench_lora_step --out $R/mixed_$rep.json 2>&1 | grep -v Warn | grep "bound 320\|bound 826"
  echo "== decode ($rep)"; timeout 60 python3 -m tools.bench_lora_step --decodes 256 --prefill "" --out $R/decode_$rep.json 2>&1 | grep -v Warn | grep "bm16"
done
echo "== resident"; timeout 60 python3 -m tools.bench_lora_step --adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $P --out $R/resident.json 2>&1 | grep -v Warn | grep "bm16"
echo "== large"; timeout 60 python3 -m tools.bench_lora_step --decodes 100 --prefill 1024,1024,1024,1024,512 --out $R/large.json 2>&1 | grep -v Warn | grep "bm16"
