#!/usr/bin/env bash
# The many-adapter serving benchmarks (S1, S2: benchmarks/run_churn_bench.sh) with the GPU adapter pool in
# the model's dtype and in fp8 (--lora-dtype fp8), one after the other on one GPU, each with its bytes bound
# and the fraction of it (tools/roofline.py), then both side by side.
#   usage: PARTS=s1 bash benchmarks/run_fp8_ab.sh OUT_DIR; PARTS=s2 bash benchmarks/run_fp8_ab.sh OUT_DIR
#   (one part a call keeps each under 10 minutes). Knobs: ORDER ("auto fp8"; "auto fp8 fp8 auto" for
#   A-B-B-A), S2_RATE_RUN (0 here), and run_churn_bench.sh's own (SERVER_FLAGS, NUM_PROMPTS, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${TMPDIR:-/tmp}/lorapipe-bench/fp8_ab}")
py=${PYTHON:-python}
parts=${PARTS:-"s1 s2"}
common=${SERVER_FLAGS:-"--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"}
mkdir -p "$out"
k=0
for dtype in ${ORDER:-auto fp8}; do
  k=$((k + 1))
  SCRATCH="$out/scratch" PARTS="$parts" S2_RATE_RUN="${S2_RATE_RUN:-0}" SERVER_FLAGS="$common --lora-dtype $dtype" \
    bash benchmarks/run_churn_bench.sh "$out/${k}_$dtype" | tail -20
done
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
keys = ("s1_ratio", "s1_bytes_bound", "s1_fraction_of_bound", "s2_throughput_ratio", "s2_bytes_bound",
        "s2_fraction_of_bound", "s2_ttft_ratio")
rows = {}
for d in sorted(p for p in out.iterdir() if (p / "churn_summary.json").exists()):
    s = json.loads((d / "churn_summary.json").read_text())
    rows[d.name] = dict(s["ratios"], tok_s={n: round(r["output_throughput"]) for n, r in s["runs"].items()})
print("| run | " + " | ".join(keys) + " |")
print("|---" * (len(keys) + 1) + "|")
for name, r in rows.items():
    print(f"| {name} | " + " | ".join("-" if r.get(k) is None else f"{r[k]:.3f}" for k in keys) + " |")
for name, r in rows.items():
    print(name, "output tok/s:", r["tok_s"])
(out / "fp8_ab_summary.json").write_text(json.dumps(rows, indent=1))
PY
