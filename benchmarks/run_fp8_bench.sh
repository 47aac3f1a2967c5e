#!/usr/bin/env bash
# fp8 base against bf16 base, 8B-shaped, 4 rank-16 adapters, A-B-B-A in one process:
# decode at batch 16 and 64, prefill of 4 x 2,048 tokens, teacher-forced quality (32 x 512 tokens) on
# random, low-rank and ordered weights (with the float32 noise floor and the per-layer hidden-state
# error; --quality-only runs only this part), and the GEMMs alone (benchmarks/bench_fp8.py).
#   usage: bash benchmarks/run_fp8_bench.sh [OUT_DIR [bench_fp8 flags]]   (checkpoints: $SCRATCH, about 16 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${TMPDIR:-/tmp}/lorapipe-bench/fp8_bench}")
py=${PYTHON:-python}
scratch=${SCRATCH:-${TMPDIR:-/tmp}/lorapipe-fp8-bench}
mkdir -p "$out"
"$py" -m benchmarks.bench_fp8 "$out" --scratch "$scratch" "${@:2}" 2>&1 | tee "$out/fp8_bench.log"
