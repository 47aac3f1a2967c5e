#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/r2; mkdir -p $R
timeout 200 python3 scratch_dev/procload.py 2>&1 | tee $R/procs.txt
run() { echo "== $*" | tee -a $R/bench.txt; python3 -m tools.bench_loader --preset 1b --ranks ${RANKS:-16} --adapter-dtype bfloat16 --reps 5 "$@" 2>&1 | tail -${TAILN:-1} | tee -a $R/bench.txt; }
run
run --tasks 1
run --tasks 2
run --tasks 1 --switch-interval-ms 5
run --switch-interval-ms 5
run --tasks 1 --threads 8 --parallel 4
run --tasks 1 --switch-interval-ms 1
RANKS=64 run --tasks 1
RANKS=64 run --tasks 1 --switch-interval-ms 5
tar -czf $OUT/results.tgz -C /tmp r2
