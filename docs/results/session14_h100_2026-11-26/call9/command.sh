#!/usr/bin/env bash
# Session 14, call 9 (one H100): tile-class grids of 1.5 c tiles (B = this tree) against the bound's grid
# (A = f7a856c, .base/f7a856c): (1) a decode step's LoRA kernels (decode_grid.py beside this), A-B-A;
# (2) the GPU tests of the backend, decode graphs and warm-up; (3) the resident 32-adapter burst A-B-B-A.
# Before the call: mkdir -p .base/f7a856c && git archive f7a856c | tar -x -C .base/f7a856c; carry .whl and .base/f7a856c.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
S=docs/results/session14_h100_2026-11-26/call9/decode_grid.py
for side in A B A; do
  if [ $side = A ]; then T=$PWD/.base/f7a856c; else T=$PWD; fi
  echo "== $side"; PYTHONPATH=/tmp/site python3 $S $T
done
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/kernels/test_triton_backend.py \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_warmup_gpu.py \
  tests/runtime/test_offline_gpu.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
PYTHON=python3 SCRATCH=/tmp/scratch timeout $((590 - SECONDS + t0)) bash tools/run_ab_serving.sh $OUT/ab32 \
  $PWD/.base/f7a856c $PWD > $OUT/ab32.txt 2>&1
echo "AB rc=$? at $((SECONDS - t0)) s"; tail -8 $OUT/ab32.txt; cat $OUT/ab32/ready.txt
for f in $OUT/ab32/*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -f $OUT/ab32/*.jsonl $OUT/ab32/server_*.log; rm -rf $OUT/ab32/scratch
