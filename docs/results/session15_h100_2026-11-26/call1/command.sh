#!/usr/bin/env bash
# Session 15, call 1 (one H100): a many-adapter decode step's LoRA kernels (decode_many.py beside this).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
D=docs/results/session15_h100_2026-11-26/call1
python3 $D/decode_many.py 2>&1 | tee $OUT/output.txt
ncu --clock-control none --profile-from-start off --metrics \
gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__occupancy_limit_registers,launch__registers_per_thread,dram__bytes_read.sum,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct \
  --csv python3 $D/decode_many.py --ncu-layer > $OUT/ncu.csv 2>$OUT/ncu.err; echo ncu rc=$?
python3 - <<'PY'
import csv, os, io
txt = open(os.environ["OUT"] + "/ncu.csv").read()
lines = [l for l in txt.splitlines() if l.startswith('"')]
rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
for r in rows:
    print(r["ID"], r["Kernel Name"][:22], r["Metric Name"][:55], r["Metric Value"])
PY
