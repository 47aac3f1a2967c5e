#!/usr/bin/env bash
# Measures on one GPU the curves benchmarks/simulate_cluster.py still interpolates (benchmarks/cluster_curves.json,
# "provisional"): the decode step time by distinct adapters per batch (1..128) at batch 64 and 256, the
# prefill step by distinct adapters, and the loader and host->device rates at the simulated adapter sizes.
#   usage: bash benchmarks/run_cluster_curves.sh [OUT_DIR]     (a few minutes on an H100; SCRATCH=... to reuse)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${TMPDIR:-/tmp}/lorapipe-bench/cluster_curves}
S=${SCRATCH:-$OUT/scratch}
PY=${PYTHON:-python}
mkdir -p "$OUT" "$S"
[ -f "$S/llama-1b/config.json" ] || $PY -m tools.make_tiny_model "$S/llama-1b" --preset 1b --dtype bfloat16 --seed 0
[ -d "$S/adapters/adapter127" ] || $PY -m tools.make_adapters "$S/llama-1b" "$S/adapters" --n 128 --ranks 16 \
  --targets all --dtype bfloat16 --seed 0
# 1. decode steps (CUDA graphs and eager) with K distinct rank-16 adapters in the batch (sequence i uses i % K),
#    every K in one process (profile_step --distinct)
for B in 64 256; do
  $PY benchmarks/profile_step.py --model "$S/llama-1b" --adapter-dir "$S/adapters" --batch $B \
    --distinct 1,2,4,8,16,32,64,128 --steps 20 --out "$OUT/decode_b${B}_k{k}.json" > "$OUT/decode_b${B}.log" 2>&1
done
# 2. one 2048-token prefill step (8 x 256) with K distinct adapters
$PY benchmarks/profile_step.py --model "$S/llama-1b" --adapter-dir "$S/adapters" --batch 8 --ctx 256 --prefill \
  --distinct 1,2,4,8 --steps 10 --out "$OUT/prefill_k{k}.json" > "$OUT/prefill.log" 2>&1
# 3. disk->host (the loader, ranks 16 and 64 as simulated) and host->device at those packed sizes
$PY -m benchmarks.bench_loader --model "$S/llama-1b" --ranks 16,64 --adapter-dtype bfloat16 > "$OUT/loader.log" 2>&1
$PY -m benchmarks.bench_h2d --model "$S/llama-1b" --sizes-mb 22.5,90.2 --reps 30 > "$OUT/h2d.log" 2>&1
# 4. one table: step ms by batch and distinct adapters (graph replay for decode, eager for prefill)
$PY - "$OUT" > "$OUT/results.md" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| batch | distinct adapters | decode graph ms (lora) | decode graph ms (base) | decode eager ms (lora) |")
print("| --- | --- | --- | --- | --- |")
for f in sorted(out.glob("decode_b*_k*.json"), key=lambda p: [int(x) for x in p.stem[8:].split("_k")]):
    r = json.loads(f.read_text())
    res, a = r["results"], r["args"]
    print(f"| {a['batch']} | {min(a['slots'], a['batch'])} | {res['lora graph']['wall_ms']:.2f} "
          f"| {res['base-only graph']['wall_ms']:.2f} | {res['lora']['wall_ms']:.2f} |")
print("\n| prefill 8 x 256 | distinct adapters | eager wall ms (lora) | eager wall ms (base) "
      "| graph ms (lora) | graph ms (base) |\n| --- | --- | --- | --- | --- | --- |")
for f in sorted(out.glob("prefill_k*.json"), key=lambda p: int(p.stem[9:])):
    r = json.loads(f.read_text())
    res = r["results"]
    print(f"| 2048 tokens | {r['args']['slots']} | {res['lora']['wall_ms']:.2f} | {res['base-only']['wall_ms']:.2f} "
          f"| {res['lora graph']['wall_ms']:.2f} | {res['base-only graph']['wall_ms']:.2f} |")
PYEOF
cat "$OUT/results.md"
echo "loader and host->device tables: $OUT/loader.log, $OUT/h2d.log"
