#!/usr/bin/env bash
# session 8, call 3 (tree d37fa34): where S2's step time goes now that its steps replay graphs. Two servers
# with the worker's step profiler over plans 500-699: one serving S2's base-only burst, one the mix burst
# (warm-up bursts run first, so plan 500 is inside the measured burst). The profiler slows both runs; their
# throughput is not a result, only the device time by kernel and the GPU-busy share.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/s8c3; mkdir -p $R
export SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3 S2_RATE_RUN=0
for pass in base mix; do
  F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0 --profile-dir $R/p_$pass --profile-steps 500:200"
  (SERVER_FLAGS="$F" S2_PASSES="$pass" timeout 260 bash tools/run_churn_bench.sh $R/$pass) > $R/$pass.txt 2>&1
  grep -h "step profile" $R/$pass/server_s2.log | cut -c1-400
  for t in $R/p_$pass/*.json.gz; do python3 -m tools.gpu_timeline $t --top 40 > $R/timeline_$pass.txt; python3 -m tools.gpu_timeline $t --top 200 --json > $R/timeline_$pass.json; done
  head -40 $R/timeline_$pass.txt
  rm -rf $R/p_$pass
done
for f in $R/*/s2_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s8c3
