#!/usr/bin/env bash
# Session 13, call 2 (one H100): the expand's grid capped at about N programs, each looping over every
# P-th tile (ExpandConfig.tile_programs), against one program a tile (N = 0), on five steps:
# tools/bench_lora_step.py --only "graphed bm16 (bound" --expand-programs 0,1056,2112,4224,8448,0
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
C1=""; C2="--decodes 256 --prefill="
C3="--adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $(printf '256,%.0s' $(seq 30))256"
C4="--decodes 100 --prefill 1024,1024,1024,1024,512"
C5="--adapters 32 --ranks 16 --decodes 256 --prefill="
for c in C1 C2 C5 C3 C4; do
  echo "== $c (${!c})"
  python3 -m tools.bench_lora_step ${!c} --only "graphed bm16 (bound" --expand-programs 0,1056,2112,4224,8448,0 \
    --out $OUT/$c.json 2>&1 | grep -E " us |Error|error"
done
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/kernels/test_lora_expand.py \
  tests/kernels/test_triton_backend.py tests/tools/test_bench_lora_step.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -1 $OUT/gpu_tests.txt
