#!/usr/bin/env bash
# Session 14, call 12 (this tree: the fused gate_up expand + activation, tile-class grids; one H100):
# issue 14's S1 (2,000 rank-16 adapters, uniform, 1,000 requests 256/128, GPU pool 4 GB, host cache 16 GB,
# against the same requests over 8 adapters; runs few, many (cold host cache), many (warm), few on one
# server) and S2 (the mix, then base-only, on one server).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
R=/tmp/s14c12; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
(SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PYTHON=python3 SERVER_FLAGS="$F" PARTS=s1 timeout 340 bash tools/run_churn_bench.sh $R/s1) > $R/s1.txt 2>&1
echo "S1 rc=$? at $((SECONDS - t0)) s"
grep -h "ratio\|^| s1\|ready" $R/s1.txt $R/s1/ready.txt
python3 -m tools.bench_runs $R/s1/s1_*.json
(SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PYTHON=python3 SERVER_FLAGS="$F" PARTS=s2 S2_PASSES="mix base" S2_RATE_RUN=0 timeout $((590 - SECONDS + t0)) bash tools/run_churn_bench.sh $R/s2) > $R/s2.txt 2>&1
echo "S2 rc=$? at $((SECONDS - t0)) s"
python3 -m tools.bench_runs $R/s2/s2_*.json
for f in $R/s1/s1_*.json $R/s2/s2_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s14c12
