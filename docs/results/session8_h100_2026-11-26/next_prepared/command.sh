#!/usr/bin/env bash
# Prepared for the next session, not run: why the LoRA expand moves its B rows at about half the shrink's
# rate per byte (docs/benchmarks.md, eighth session, calls 16 and 17 ruled out grid order and per-program
# chunking). Nsight Compute on the 256-decode step of tools/bench_lora_step.py as the step graph launches
# it: a few expand and shrink launches of the gate_up and down groups, with occupancy, memory throughput and
# warp stall sections. Clocks left alone (--clock-control none, per the device's METHOD.md).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
R=$OUT/ncu; mkdir -p $R
# compile first, outside the profiler
python3 -m tools.bench_lora_step --decodes 256 --prefill "" --only "graphed bm16 (bound 256)" > $R/plain.txt 2>&1
for k in expand shrink; do
  timeout 240 ncu --clock-control none --graph-profiling node -k "regex:_lora_${k}_kernel" --launch-skip 64 --launch-count 6 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats -o $R/$k -f \
    python3 -m tools.bench_lora_step --decodes 256 --prefill "" --only "graphed bm16 (bound 256)" > $R/${k}_run.txt 2>&1
  ncu --import $R/$k.ncu-rep --page details --print-units base > $R/$k.txt 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory|Block Limit|Grid Size|Stall" $R/$k.txt | head -60
done
