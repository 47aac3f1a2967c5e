#!/usr/bin/env bash
# Session 13, call 7 (one H100): step graphs per LoRA tile class too (B = this tree) against decode graphs
# alone per class (A = f7ce4f8, .base/f7ce4f8): (1) the GPU tests of graphs, warm-up, overlap and the
# offline engine; (2) bench_lora_step on an S1-like mixed step (8 rank-16 adapters, 8 x 256 prefill +
# 192 decodes) and two others, configs as for 32 / 128 tiles / the bound; (3) the resident 32-adapter
# burst A-B-B-A with capture counts and times.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
timeout 280 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/kernels/test_triton_backend.py \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_step_graphs.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/stages/worker/test_warmup_gpu.py \
  tests/stages/worker/test_layer_waits_gpu.py tests/stages/worker/test_overlap_schedule_gpu.py \
  tests/integration/test_overlap_gpu.py tests/runtime/test_offline_gpu.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
C9="--adapters 8 --ranks 16 --decodes 192 --prefill 256,256,256,256,256,256,256,256"
C10="--adapters 32 --ranks 16 --decodes 128 --prefill 256,256,256,256"
C11="--adapters 64 --decodes 160 --prefill 512,512"
for c in C9 C10 C11; do
  echo "== $c (${!c})"
  python3 -m tools.bench_lora_step ${!c} --only "graphed bm16 (bound" --config-tiles 0,32,128 2>&1 | grep -E " us |Error|error"
done
PYTHON=python3 SCRATCH=/tmp/scratch timeout $((590 - SECONDS + t0)) bash tools/run_ab_serving.sh $OUT/ab32 \
  $PWD/.base/f7ce4f8 $PWD > $OUT/ab32.txt 2>&1
echo "AB rc=$? at $((SECONDS - t0)) s"; tail -8 $OUT/ab32.txt; cat $OUT/ab32/ready.txt
for f in A1 B2 B3 A4; do grep -h "captured" $OUT/ab32/server_$f.log | sed "s/^/$f /" | cut -c1-150; done
for f in $OUT/ab32/*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
rm -f $OUT/ab32/*.jsonl $OUT/ab32/*.log; rm -rf $OUT/ab32/scratch
