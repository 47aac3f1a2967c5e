#!/usr/bin/env bash
# session 10, call 1 (tree 2a688ec): Nsight Compute on the LoRA expand and shrink of the 256-decode step
# of tools/bench_lora_step.py as the step graph launches them (the eighth session's prepared call), the
# bench's four cases for a baseline, then the GPU tests on this tree.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
R=$OUT/ncu; mkdir -p $R
t0=$SECONDS
python3 -m tools.bench_lora_step --decodes 256 --prefill "" --only "graphed bm16 (bound 256)" > $R/plain.txt 2>&1
tail -5 $R/plain.txt
for k in expand shrink; do
  timeout 150 ncu --clock-control none --graph-profiling node -k "regex:_lora_${k}_kernel" --launch-skip 64 --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section SourceCounters -o $R/$k -f \
    python3 -m tools.bench_lora_step --decodes 256 --prefill "" --only "graphed bm16 (bound 256)" > $R/${k}_run.txt 2>&1
  echo "$k rc=$? at $((SECONDS - t0)) s"; tail -3 $R/${k}_run.txt
  ncu --import $R/$k.ncu-rep --page details --print-units base > $R/$k.txt 2>&1
  grep -E "^  [a-z_]+kernel|Duration|Memory Throughput|DRAM Throughput|L2 Hit|L1/TEX Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Dynamic Shared|Block Limit|Grid Size|Block Size|Warp Cycles Per Issued|Stall|Eligible|Issued Warp" $R/$k.txt | head -70
done
echo "ncu done at $((SECONDS - t0)) s"
B=$OUT/bench; mkdir -p $B
python3 -m tools.bench_lora_step --out $B/mixed.json > $B/mixed.txt 2>&1; tail -6 $B/mixed.txt
python3 -m tools.bench_lora_step --decodes 256 --prefill "" > $B/decode.txt 2>&1; tail -6 $B/decode.txt
echo "bench done at $((SECONDS - t0)) s"
timeout $((570 - SECONDS + t0)) python3 -m pytest -q -p no:cacheprovider tests/stages/worker/test_warmup_gpu.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/kernels/test_triton_backend.py tests/runtime/test_offline_gpu.py \
  tests/stages/worker/test_overlap_schedule_gpu.py tests/stages/worker/test_layer_waits_gpu.py \
  tests/integration/test_overlap_gpu.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -5 $OUT/gpu_tests.txt
