#!/bin/bash
# Session 14, call 1: the gate_up expand fused with the activation (kernels/lora_expand_act.py) against
# the expand then silu_mul, per step shape, graphed (tools/bench_lora_step.py --act both).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
B="python3 -m tools.bench_lora_step --act both --only graphed"
P31=$(python3 -c "print(','.join(['256']*31))")
echo "== S2-like mixed: 80 adapters, 190 decodes + 512 + 256"; $B --out $OUT/mixed.json
echo "== 256 decodes, 80 adapters"; $B --decodes 256 --prefill "" --out $OUT/dec80.json
echo "== 256 decodes, 8 rank-16 adapters"; $B --adapters 8 --ranks 16 --decodes 256 --prefill "" --out $OUT/dec8.json
echo "== 32 rank-16 adapters, 31 x 256 prefill + 64 decodes"; $B --adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $P31 --out $OUT/res32.json
echo "== 80 adapters, 4 x 1024 + 512 prefill + 100 decodes"; $B --decodes 100 --prefill 1024,1024,1024,1024,512 --out $OUT/long.json
