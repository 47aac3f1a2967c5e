#!/bin/bash
# Session 14, call 2: the gate_up expand fused with the activation for row blocks of one adapter, the
# plain expand for the other rows (kernels/lora_expand_act.py), against the expand then silu_mul, per step
# shape, graphed at the 16-token tile (tools/bench_lora_step.py --act both).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
b() { python3 -m tools.bench_lora_step --act both --only "graphed bm16" "$@"; }
P31=$(python3 -c "print(','.join(['256']*31))")
echo "== S2-like mixed: 80 adapters, 190 decodes + 512 + 256"; b --out $OUT/mixed.json
echo "== 256 decodes, 80 adapters"; b --decodes 256 --prefill "" --out $OUT/dec80.json
echo "== 256 decodes, 8 rank-16 adapters"; b --adapters 8 --ranks 16 --decodes 256 --prefill "" --out $OUT/dec8.json
echo "== 32 rank-16 adapters, 31 x 256 prefill + 64 decodes"; b --adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $P31 --out $OUT/res32.json
echo "== 80 adapters, 4 x 1024 + 512 prefill + 100 decodes"; b --decodes 100 --prefill 1024,1024,1024,1024,512 --out $OUT/long.json
