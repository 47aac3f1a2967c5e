#!/usr/bin/env bash
# Session 13, call 1 (one H100): the re-applied follow-ups (f3ebb02, 867b32b) and the expand as a
# programmatic dependent of its shrink (PDL): (1) the GPU test files; (2) tools/bench_lora_step.py on four
# steps, each variant timed with PDL off, on, on, off (B = this tree), and A = ab2e973 (.base/ab2e973,
# the kernels before the change) before and after B on the first two steps.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/kernels \
  tests/integration/test_overlap_gpu.py tests/runtime/common/test_host_pool.py tests/runtime/test_offline_gpu.py \
  tests/stages/worker/test_decode_graphs.py tests/stages/worker/test_layer_waits_gpu.py \
  tests/stages/worker/test_lora_pool.py tests/stages/worker/test_overlap_schedule_gpu.py \
  tests/stages/worker/test_step_graphs.py tests/stages/worker/test_step_graphs_gpu.py \
  tests/stages/worker/test_warmup.py tests/stages/worker/test_warmup_gpu.py tests/tools/test_bench_lora_step.py \
  > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
C1=""; C2="--decodes 256 --prefill="
C3="--adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $(printf '256,%.0s' $(seq 30))256"
C4="--decodes 100 --prefill 1024,1024,1024,1024,512"
A() { (cd .base/ab2e973 && PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_lora_step $1 --only "graphed bm16 (bound" 2>&1 | grep " us "); }
for c in C1 C2; do echo "== A $c"; A "${!c}"; done
for c in C1 C2 C3 C4; do
  echo "== B $c (${!c})"
  python3 -m tools.bench_lora_step ${!c} --only "graphed bm16 (bound" --pdl-ab --out $OUT/$c.json 2>&1 | grep -E " us |Error|error"
done
for c in C1 C2; do echo "== A $c again"; A "${!c}"; done
echo "done at $((SECONDS - t0)) s"
